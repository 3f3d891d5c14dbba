"""The allreduce algorithm's choice: a pure function of the buffer's size, the settings and
the world's hosts (native/src/algorithm.h), read here as a table without forming a world."""

from __future__ import annotations

import pytest

from elastic.ring import _native

Algorithm = _native.Algorithm
KIB, MIB = 1 << 10, 1 << 20
TWO_BY_TWO = ["a", "a", "b", "b"]
UNEVEN = ["a", "a", "a", "b"]


def config(setting="auto", small_bytes=32 * KIB, hierarchical_bytes=4 * MIB):
    c = _native.CommConfig()
    c.algorithm, c.small_bytes, c.hierarchical_bytes = setting, small_bytes, hierarchical_bytes
    return c


CHOICES = [
    # (hosts, setting, small_bytes, hierarchical_bytes, nbytes) -> algorithm
    ((TWO_BY_TWO, "auto", 32 * KIB, 4 * MIB, 1), Algorithm.SmallMessage),
    ((TWO_BY_TWO, "auto", 32 * KIB, 4 * MIB, 32 * KIB), Algorithm.SmallMessage),
    ((TWO_BY_TWO, "auto", 32 * KIB, 4 * MIB, 32 * KIB + 1), Algorithm.Ring),
    ((TWO_BY_TWO, "auto", 32 * KIB, 4 * MIB, 4 * MIB), Algorithm.Ring),
    ((TWO_BY_TWO, "auto", 32 * KIB, 4 * MIB, 4 * MIB + 1), Algorithm.Hierarchical),
    ((UNEVEN, "auto", 32 * KIB, 4 * MIB, 64 * MIB), Algorithm.Hierarchical),
    # "hierarchical" takes every size where the shape allows, small ones too
    ((TWO_BY_TWO, "hierarchical", 32 * KIB, 4 * MIB, 1), Algorithm.Hierarchical),
    ((TWO_BY_TWO, "hierarchical", 32 * KIB, 4 * MIB, 64 * MIB), Algorithm.Hierarchical),
    # "ring" never leaves the flat ring
    ((TWO_BY_TWO, "ring", 32 * KIB, 4 * MIB, 1), Algorithm.SmallMessage),
    ((TWO_BY_TWO, "ring", 32 * KIB, 4 * MIB, 1 << 30), Algorithm.Ring),
    # shapes the hierarchy does not apply to: the flat ring, whatever the setting
    (([], "hierarchical", 32 * KIB, 4 * MIB, 64 * MIB), Algorithm.Ring),
    ((["a", "b", "a", "b"], "hierarchical", 32 * KIB, 4 * MIB, 64 * MIB), Algorithm.Ring),
    ((["a", "a", "a"], "hierarchical", 32 * KIB, 4 * MIB, 64 * MIB), Algorithm.Ring),
    ((["a", "b", "c"], "hierarchical", 32 * KIB, 4 * MIB, 64 * MIB), Algorithm.Ring),
    ((["a", "b", "c"], "auto", 32 * KIB, 4 * MIB, 1), Algorithm.SmallMessage),
    # the thresholds are the settings': no small-message path, a hierarchy above 1 KiB
    ((TWO_BY_TWO, "auto", 0, 4 * MIB, 1), Algorithm.Ring),
    ((TWO_BY_TWO, "auto", 32 * KIB, KIB, 2 * KIB), Algorithm.Hierarchical),
    ((TWO_BY_TWO, "auto", 32 * KIB, KIB, KIB), Algorithm.SmallMessage),
]


@pytest.mark.parametrize("case,want", CHOICES, ids=[f"{c[1]}-{len(c[0])}ranks-{c[4]}B" for c, _ in CHOICES])
def test_the_algorithm_is_a_pure_function_of_size_settings_and_hosts(case, want):
    hosts, setting, small, hier, nbytes = case
    cfg = config(setting, small, hier)
    # Every rank of the world makes the same choice: no rank may run another algorithm.
    picked = {_native.choose_allreduce(nbytes, cfg, hosts, rank) for rank in range(max(1, len(hosts)))}
    assert picked == {want}


def test_python_is_told_ring_or_hierarchical_from_one_table():
    names = {a: _native.algorithm_name(a) for a in Algorithm}
    assert names == {Algorithm.Ring: "ring", Algorithm.SmallMessage: "ring",
                     Algorithm.Hierarchical: "hierarchical"}


def test_a_rank_outside_the_hosts_is_refused():
    with pytest.raises(ValueError, match="rank 4 has no entry in hosts"):
        _native.choose_allreduce(1, config(), TWO_BY_TWO, 4)
