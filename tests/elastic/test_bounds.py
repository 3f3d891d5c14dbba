"""What a peer announces is bounded before it is used: the verdicts of a sync, the row counts of an
allgather, the sampler state a sync brings (pure functions), and an allgather's forged row count
between real processes."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import elastic
from elastic.ring.communicator import MAX_ALLGATHER_BYTES, allgather_counts_problem
from elastic.state.sync import SyncVerdict, judge_sync, sync_size_problem
from tests.native.harness import run_world

T, F = True, False


@pytest.mark.parametrize("root, accepted, verdict", [
    (0, [T, T, T], SyncVerdict((), ())),                        # everyone took it: go on
    (0, [T], SyncVerdict((), ())),                              # a world of one
    (1, [T, F, T], SyncVerdict((1,), (1,))),                    # the root could not send: its failure
    (1, [F, T, F], SyncVerdict((0, 2), (1,))),                  # every other rank refused: the root's bytes
    (0, [T, F], SyncVerdict((1,), (0,))),                       # two ranks: the refuser is believed
    (0, [T, F, F, T], SyncVerdict((1, 2), (0,))),               # two of the three others refused: the root
    (0, [T, F, T, F, T], SyncVerdict((1, 3), (1, 3))),          # half the others refused: the refusers
    (0, [T, F, T], SyncVerdict((1,), (1,))),                    # one refuser, the other took it: the refuser
    (2, [F, F, T, F, T], SyncVerdict((0, 1, 3), (2,))),         # three of four others refused: the root
    (3, [T, T, F, F], SyncVerdict((2, 3), (3,))),               # the root refused itself, whoever else did
])
def test_the_sync_verdict_blames_the_root_when_it_cannot_send_or_most_refuse_else_the_refusers(root, accepted,
                                                                                                verdict):
    assert judge_sync(root, accepted) == verdict


@pytest.mark.parametrize("size, available, says", [
    (0, 10, None),
    (10, 10, None),
    (-1, 10, "announced a state of -1 bytes"),
    (1 << 60, 1 << 40, f"announced a state of {1 << 60} bytes, more than the {1 << 40} bytes of memory available"),
    (11, 10, "more than the 10 bytes"),
])
def test_a_sync_state_size_is_received_only_when_it_is_not_negative_and_fits_the_memory_available(size, available,
                                                                                                  says):
    got = sync_size_problem(size, available)
    assert got is None if says is None else says in got


@pytest.mark.parametrize("counts, row_bytes, limit, problem", [
    ([1, 2, 3], 8, 100, None),
    ([1, -1, 3], 8, 100, (1, "announced -1 rows")),
    ([-5, -1], 8, 100, (0, "announced -5 rows")),
    ([1, 20, 3], 8, 100, (1, "announced 20 rows of 8 bytes; the gather would take 192 bytes, more than 100")),
    ([12, 1, 12], 8, 100, (0, "announced 12 rows")),         # the largest, the lowest rank among equals
    ([1 << 40, 0], 1 << 30, MAX_ALLGATHER_BYTES, (0, f"announced {1 << 40} rows")),
])
def test_allgather_row_counts_are_bounded_naming_the_rank_to_blame(counts, row_bytes, limit, problem):
    got = allgather_counts_problem(counts, row_bytes, limit)
    if problem is None:
        assert got is None
    else:
        assert got[0] == problem[0] and got[1].startswith(problem[1]), got


@pytest.mark.parametrize("change, says", [
    ({"remaining": np.array([0, 40])}, "outside this dataset of 40"),
    ({"remaining": np.array([-1])}, "outside this dataset"),
    ({"remaining": np.arange(41) % 40}, "outside this dataset"),
    ({"remaining": np.array([0.5])}, "not a 1-D integer array"),
    ({"remaining": [1, 2]}, "not a 1-D integer array"),
    ({"partition_size": 0}, "out of range"),
    ({"partition_size": 1 << 40}, "out of range"),
    ({"processed": -3}, "out of range"),
    ({"epoch": "3"}, "epoch is not an int"),
    ({"epoch": True}, "epoch is not an int"),
])
def test_a_sampler_state_that_would_index_past_the_dataset_or_partition_absurdly_is_refused(change, says):
    sampler = elastic.ElasticSampler(list(range(40)), shuffle=True, seed=0)
    good = sampler.state_dict()
    sampler.check_state_dict(good)
    with pytest.raises(ValueError, match=says):
        sampler.check_state_dict(dict(good, **change))
    missing = dict(good)
    del missing["processed"]
    with pytest.raises(ValueError, match="not an ElasticSampler state"):
        sampler.check_state_dict(missing)


def _allgather_with_a_forged_row_count(count, comm):
    rows = np.arange(6, dtype=np.float32).reshape(2, 3) + comm.rank
    if comm.rank == 1:
        # What the allgather's announcement carries: rows, ndim, dtype, trailing dims (-1 padded).
        meta = np.full(16, -1, dtype=np.int64)
        meta[:4] = [count, 2, 2, 3]
        comm._native.allgather_(meta, np.empty(16 * comm.size, dtype=np.int64), [meta.nbytes] * comm.size)
        return None
    with pytest.raises(elastic.BadPeerError) as e:
        comm.allgather(rows)
    return str(e.value), e.value.peer_rank, e.value.op


@pytest.mark.parametrize("count", [-1, 1 << 40])
def test_an_allgather_row_count_out_of_bounds_blames_the_rank_that_announced_it(count):
    results = run_world(3, functools.partial(_allgather_with_a_forged_row_count, count), timeout=60)
    for message, blamed, op in (results[0], results[2]):
        assert blamed == 1 and op == "allgather", message
        assert f"rank 1 announced {count} rows" in message
