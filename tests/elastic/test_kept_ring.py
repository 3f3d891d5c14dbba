"""The ring kept after the run (elastic.ring.arrival): every member enters each collective within
ELASTIC_AFTER_RUN_TIMEOUT, and the rank after one that does not names it. Real rings of worker
processes over loopback (tests/native/harness.py); the messages as a table."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from elastic.ring.arrival import SETTING, Arrival, failure_message
from elastic.ring.errors import ErrorKind
from tests.native.harness import World

BOUND_S = 1.0


def named(rank: int) -> str:
    return f"worker w{rank} (rank {rank})"


@pytest.mark.parametrize("kind, missed, peer, says, not_says", [
    (ErrorKind.Timeout, True, "worker hA-2 (rank 2)",
     f"worker hA-2 (rank 2) did not arrive at barrier within 1.5 s ({SETTING})", "gave up"),
    (ErrorKind.Timeout, True, "rank 7", f"rank 7 did not arrive at barrier within 1.5 s ({SETTING})", "gave up"),
    (ErrorKind.Propagated, False, "worker b (rank 1)", "worker b (rank 1) gave up on it because of a failure further "
     "round the ring", "did not arrive at"),
    (ErrorKind.PeerLost, False, "worker c (rank 0)", "worker c (rank 0) closed its ring", "did not arrive at"),
    (ErrorKind.Propagated, False, "", "barrier on the ring kept after the run failed: core says", "gave up"),
    (ErrorKind.Aborted, False, "", "barrier on the ring kept after the run failed: core says", "did not arrive"),
    (ErrorKind.Timeout, False, "worker d (rank 3)", "failed: core says", "did not arrive"),
], ids=["missing-named", "missing-outside-view", "propagated", "peer-closed", "propagated-no-peer", "aborted",
        "collective-timeout"])
def test_what_a_rank_of_the_kept_ring_says_when_a_collective_fails(kind, missed, peer, says, not_says):
    text = failure_message("barrier", kind, missed_arrival=missed, peer=peer, bound_s=1.5, original="core says")
    assert says in text and not_says not in text, text


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan")])
def test_an_arrival_bound_that_is_not_positive_is_refused_naming_the_setting(bound):
    with pytest.raises(ValueError, match=SETTING):
        Arrival(bound, named)


def _kept(missing: int, late_s: float = 0.0):
    """A worker body: the ring kept after the run; rank ``missing`` waits ``late_s`` before its
    barrier (forever when late_s is 0: it never comes), the others enter at once."""
    def body(comm):
        comm.arrival = Arrival(BOUND_S, named)
        if comm.rank == missing:
            if not late_s:
                time.sleep(30)   # alive, never in the collective (the test ends it)
                return None
            time.sleep(late_s)
        started = time.monotonic()
        try:
            comm.barrier()
            total = comm.allreduce_(np.array([comm.rank + 1.0]), op=_sum())
        except Exception as e:  # noqa: BLE001 (what each rank got is the result)
            return {"error": type(e).__name__, "kind": e.kind.name, "peer_rank": e.peer_rank, "text": str(e),
                    "took": time.monotonic() - started}
        return {"sum": float(total[0]), "took": time.monotonic() - started}
    return body


def _sum():
    import elastic
    return elastic.Sum


@pytest.mark.slow
@pytest.mark.parametrize("n, missing", [(3, 2), (3, 0), (4, 1)])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_member_that_skips_a_collective_is_named_and_the_others_are_released_within_the_bound(n, missing,
                                                                                             transport):
    with World(n, _kept(missing), transport=transport) as w:
        w.wait_formed()
        got = {r: w.expect(r, "ok", timeout=20)[1] for r in range(n) if r != missing}
    detector = (missing + 1) % n
    for r, result in got.items():
        assert "error" in result, (r, got)
        assert result["took"] < BOUND_S + 2.0, (r, got)   # the bound, not the collective timeout
        assert result["error"] == "WorkerLostError", (r, got)
    said = got[detector]
    assert said["kind"] == "Timeout" and said["peer_rank"] == missing, got
    assert f"worker w{missing} (rank {missing}) did not arrive at barrier within {BOUND_S:g} s ({SETTING})" \
        in said["text"], said
    for r, result in got.items():
        if r != detector:   # a failure further round the ring reached them: nobody alive is blamed
            assert result["peer_rank"] is None and "kept after the run" in result["text"], (r, got)


@pytest.mark.slow
def test_every_member_arriving_within_the_bound_runs_the_collectives_as_usual():
    # Rank 1 comes 0.3 s late, within the 1 s bound: the barrier waits for it and the sum is right.
    with World(3, _kept(1, late_s=0.3)) as w:
        results = w.results(timeout=30)
    assert [r.get("sum") for r in results] == [6.0, 6.0, 6.0], results


@pytest.mark.parametrize("raw, message", [
    ("0", f"{SETTING}=0 must be positive"),
    ("nan", f"{SETTING}=nan must be positive"),
    ("-1", f"{SETTING}='-1' must not be negative"),
    ("soon", f"{SETTING}='soon' is not a valid float"),
])
def test_a_bad_after_run_timeout_is_refused_naming_the_variable(raw, message):
    from elastic.runtime.worker_config import WorkerConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        WorkerConfig.from_env({"ELASTIC_RENDEZVOUS": "127.0.0.1:1", SETTING: raw})
    assert WorkerConfig.from_env({"ELASTIC_RENDEZVOUS": "127.0.0.1:1"}).after_run_timeout == 300.0
