"""The collective timeout means one thing on every path and world size: a rank fails a
collective (ErrorKind Timeout) when it has been in it for the timeout, whatever its
neighbours sent meanwhile; a peer away for less than that costs nothing.

Paths: the ring over TCP and over shared memory, the small-message path (an allgather of
whole buffers) and the hierarchical path of a mixed world (two hosts of two ranks)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import elastic

from .harness import World, mixed_hosts

SMALL, RING = 16, 1 << 20   # float32 elements: 64 bytes (small-message path), 4 MiB (the ring)
PATHS = [pytest.param("tcp", SMALL, id="tcp-small"), pytest.param("tcp", RING, id="tcp-ring"),
         pytest.param("shm", SMALL, id="shm-small"), pytest.param("shm", RING, id="shm-ring")]


def _late(delays: dict, absent: int, elements: int):
    """A worker body: one allreduce to warm the ring, then the ranks enter the next one after
    ``delays[rank]`` seconds (fault injection: a rank busy elsewhere), ``absent`` not at all
    until the parent says so. Returns (outcome, seconds in the collective, reason)."""
    def body(comm, conn):
        buf = np.ones(elements, dtype=np.float32)
        comm.allreduce_(buf, elastic.Sum)
        if comm.rank == absent:
            if not conn.poll(60):
                raise TimeoutError("the parent never let the absent rank go on")
            conn.recv()
        else:
            time.sleep(delays.get(comm.rank, 0.0))
        entered = time.monotonic()
        try:
            comm.allreduce_(buf, elastic.Sum)
        except elastic.WorkerLostError as e:
            return "failed", time.monotonic() - entered, e.reason
        return "ok", time.monotonic() - entered, float(buf[0])

    body.wants_conn = True
    return body


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("transport,elements", PATHS)
def test_a_peer_busy_for_less_than_the_timeout_costs_nothing(n, transport, elements):
    timeout, away = 4.0, 1.5
    with World(n, _late({}, absent=0, elements=elements), config=elastic.CommConfig(timeout=timeout),
               transport=transport) as w:
        w.wait_formed()
        time.sleep(away)   # rank 0 is busy elsewhere (fault injection)
        w.send(0, "go")
        results = [w.expect(r, "ok", timeout=60)[1] for r in range(n)]
    assert all(outcome == "ok" and value == n * n for outcome, _, value in results), results


def _entered_late_timeout(n, transport, elements, hosts=None, config=None):
    """Rank 0 never enters; the last rank enters at once, the others 1.2 s later; timeout 2 s."""
    timeout, late = 2.0, 1.2
    delays = {r: late for r in range(1, n - 1)}
    config = config or elastic.CommConfig(timeout=timeout)
    with World(n, _late(delays, absent=0, elements=elements), config=config,
               transport=hosts or transport) as w:
        w.wait_formed()
        results = {r: w.expect(r, "ok", timeout=60)[1] for r in range(1, n)}
        w.send(0, "go")   # let rank 0 end (its collective fails on the broken ring)
        w.message(0, 30)
    return timeout, late, results


@pytest.mark.slow
@pytest.mark.parametrize("transport,elements", PATHS)
def test_the_timeout_counts_from_entering_the_collective_not_from_the_last_byte_a_neighbour_sent(
        transport, elements):
    # The last rank hears from rank 1 when rank 1 enters, 1.2 s late; it must still fail 2 s
    # after it entered, as rank 1 and every rank of any world would.
    n = 3
    timeout, late, results = _entered_late_timeout(n, transport, elements)
    outcome, took, reason = results[n - 1]
    assert outcome == "failed" and reason == "timeout", results
    assert timeout <= took < timeout + 0.6, f"the last rank failed {took:.2f} s after entering: {results}"
    # Rank 1 entered 1.2 s later and learns of the failure from its neighbour by then.
    outcome, took, reason = results[1]
    assert outcome == "failed" and took < timeout - late + 0.6, results


@pytest.mark.slow
def test_the_timeout_counts_from_entering_on_the_hierarchical_path_too():
    # Two hosts of two ranks: rank 0 (a leader) never enters; rank 3 enters at once and waits
    # through every phase, rank 2 (its host's leader) 1.2 s later.
    config = elastic.CommConfig(timeout=2.0, algorithm="hierarchical")
    timeout, late, results = _entered_late_timeout(4, None, RING, hosts=mixed_hosts(2, 2), config=config)
    outcome, took, reason = results[3]
    assert outcome == "failed" and reason == "timeout", results
    assert timeout <= took < timeout + 0.6, f"rank 3 failed {took:.2f} s after entering: {results}"


def test_the_default_timeout_leaves_hangs_to_the_heartbeat():
    # Hung, stopped and partitioned processes are fenced by the rendezvous heartbeat within
    # seconds; the collective timeout only catches a live rank that never enters, so it is
    # torch's gloo default, long enough for a rank busy evaluating or saving.
    assert elastic.CommConfig().timeout == 1800.0
    assert elastic.CommConfig.from_env({}).timeout == 1800.0
