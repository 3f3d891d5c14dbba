"""The hierarchical allreduce of a mixed world: when it applies, numpy's bits on every rank,
failures and aborts seen in every phase, and the choice between it and the flat ring."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import elastic

from .harness import HIERARCHICAL, World, allreduce_forever, kill_mid_allreduce, mixed_hosts, run_world
from .test_collectives import _random_floats, check_matrix_on_every_rank

# ranks per host, in rank order
LAYOUTS = {"2x2": (2, 2), "3+1": (3, 1), "1+2+2": (1, 2, 2)}


def _shape(comm):
    return comm.hierarchy, comm.hierarchical_link_kinds, comm.link_kinds, comm.algorithm_for(1)


def test_two_hosts_of_two_form_a_local_ring_and_a_leaders_ring():
    results = run_world(4, _shape, transport=mixed_hosts(2, 2), config=HIERARCHICAL)
    for rank, (h, (local, leaders), flat, algo) in enumerate(results):
        assert h["applies"] and algo == "hierarchical"
        assert (h["host"], h["local_rank"], h["local_size"], h["prev_leader"], h["next_leader"]) == \
            (rank // 2, rank % 2, 2, 2 - rank // 2 * 2, 2 - rank // 2 * 2)
        assert local == ("shm", "shm")  # host mates: shared memory both ways
        assert leaders == (("tcp", "tcp") if rank % 2 == 0 else ())  # leaders only, across hosts
    # The flat ring is still there (small messages, other collectives), mixed as before.
    assert [r[2] for r in results] == [("shm", "tcp"), ("tcp", "shm"), ("shm", "tcp"), ("tcp", "shm")]


def test_uneven_hosts_a_host_of_one_rank_is_only_a_leader():
    results = run_world(4, _shape, transport=mixed_hosts(3, 1), config=HIERARCHICAL)
    assert [r[0]["local_size"] for r in results] == [3, 3, 3, 1]
    assert [r[1] for r in results] == [(("shm", "shm"), ("tcp", "tcp")), (("shm", "shm"), ()),
                                       (("shm", "shm"), ()), ((), ("tcp", "tcp"))]


@pytest.mark.parametrize("hosts,why", [
    (["a", "b", "a", "b"], "not contiguous"),
    (["a", "a", "a"], "one host"),
    (["a", "b", "c"], "one rank"),
    (None, "no host names"),
])
def test_where_it_does_not_apply_every_allreduce_takes_the_flat_ring(hosts, why):
    results = run_world(len(hosts or "abc"), _shape, transport=hosts or "tcp", config=HIERARCHICAL)
    for h, kinds, _, algo in results:
        assert not h["applies"] and why in h["why_not"], h
        assert kinds == ((), ()) and algo == "ring"


def test_algorithm_ring_forms_no_extra_rings():
    results = run_world(4, _shape, transport=mixed_hosts(2, 2), config=elastic.CommConfig(algorithm="ring"))
    for h, kinds, _, algo in results:
        assert not h["applies"] and "ring" in h["why_not"] and kinds == ((), ()) and algo == "ring"


@pytest.mark.slow
@pytest.mark.parametrize("segment", [1 << 20, 4096], ids=["default-segments", "small-segments"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_hierarchical_allreduce_matches_numpy_bitwise_on_every_rank(layout, segment):
    # Every dtype and op, sizes 0..400k elements (fewer elements than ranks included), all
    # through the hierarchical path.
    config = elastic.CommConfig(timeout=60, algorithm="hierarchical", segment_bytes=segment)
    check_matrix_on_every_rank(sum(LAYOUTS[layout]), transport=mixed_hosts(*LAYOUTS[layout]), config=config)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x2", "1+2+2"])
def test_hierarchical_allreduce_of_arbitrary_floats_is_identical_on_every_rank(layout):
    results = run_world(sum(LAYOUTS[layout]), _random_floats, transport=mixed_hosts(*LAYOUTS[layout]),
                        config=HIERARCHICAL)
    assert all(r == results[0] for r in results)


def _auto(comm):
    small, large = comm.config.hierarchical_bytes // 4, comm.config.hierarchical_bytes // 4 + 1
    picked = (comm.algorithm_for(small * 4), comm.algorithm_for(large * 4))
    out = []
    for count in (small, large):
        t = np.full(count, comm.rank + 1, dtype=np.int64 if count == small else np.float32)
        before = comm.ops_run
        comm.allreduce_(t, elastic.Sum)
        out.append((bool((t == sum(range(1, comm.size + 1))).all()), comm.ops_run - before))
    return picked, out


def test_auto_takes_the_ring_up_to_the_threshold_and_the_hierarchy_above():
    config = elastic.CommConfig(timeout=60, hierarchical_bytes=1 << 20)
    for picked, out in run_world(4, _auto, transport=mixed_hosts(2, 2), config=config):
        assert picked == ("ring", "hierarchical")
        assert out == [(True, 1), (True, 1)]  # one collective each, whichever the path


def test_algorithm_is_read_from_the_environment_and_checked():
    env = {"ELASTIC_ALLREDUCE_ALGORITHM": " Hierarchical ", "ELASTIC_HIERARCHICAL_BYTES": "1024"}
    cfg = elastic.CommConfig.from_env(env)
    assert (cfg.algorithm, cfg.hierarchical_bytes) == ("hierarchical", 1024)
    assert elastic.CommConfig.from_env({}).algorithm == "auto"
    assert elastic.CommConfig().hierarchical_bytes == 4 << 20
    with pytest.raises(ValueError, match="ELASTIC_ALLREDUCE_ALGORITHM"):
        elastic.CommConfig.from_env({"ELASTIC_ALLREDUCE_ALGORITHM": "tree"})
    with pytest.raises(ValueError, match="hierarchical_bytes"):
        elastic.CommConfig(hierarchical_bytes=-1)
    from elastic.ring import _native
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        _native.CommConfig().algorithm = "tree"  # the core's own struct checks the name too


def _abort_in_a_phase(comm, conn):
    # Rank 3 (host b's non-leader) never joins, so: rank 2 waits in phase 1 (host b's local
    # allreduce), rank 0 in phase 2 (leaders, waiting on rank 2), rank 1 in phase 3 (waiting
    # for rank 0's broadcast). One of them aborts from another thread.
    if comm.rank == 3:
        if not conn.poll(60):
            raise TimeoutError("parent never said stop")
        conn.recv()
        return None
    aborter = conn.recv()
    fired = {}

    def abort():
        time.sleep(0.3)  # let every rank block in its phase first
        fired["t"] = time.monotonic()
        comm.abort("test abort")

    th = threading.Thread(target=abort) if comm.rank == aborter else None
    if th:
        th.start()
    try:
        comm.allreduce_(np.ones(1 << 20, dtype=np.float32), elastic.Sum)
        result = ("no error", None)
    except elastic.WorkerLostError as e:
        result = (e.reason, time.monotonic())
    if th:
        th.join()
        return result[0], result[1] - fired["t"]
    return result


_abort_in_a_phase.wants_conn = True


@pytest.mark.slow
@pytest.mark.parametrize("aborter,phase", [(2, 1), (0, 2), (1, 3)], ids=["phase1", "phase2", "phase3"])
def test_abort_in_any_phase_fails_the_allreduce_within_50ms_and_wakes_the_others(aborter, phase):
    with World(4, _abort_in_a_phase, config=HIERARCHICAL, transport=mixed_hosts(2, 2)) as w:
        w.wait_formed()
        for r in range(3):
            w.send(r, aborter)
        results = {r: w.expect(r, "ok")[1] for r in range(3)}
        w.send(3, "stop")
        w.expect(3, "ok")
    reason, latency = results[aborter]
    assert reason == "aborted" and latency < 0.05, results
    # The others learn of it from the aborted rank's links (directly or passed on), never by deadline.
    for r in range(3):
        assert results[r][0] in ("aborted", "propagated", "peer_lost"), results


@pytest.mark.slow
@pytest.mark.parametrize("victim", [3, 2])
def test_sigkill_with_uneven_hosts_fails_every_survivor_within_half_a_second(victim):
    # Hosts a, a, a, b: rank 3 is a host of its own (a leader with no local ring), rank 2 the
    # end of host a's local ring.
    errors = kill_mid_allreduce(4, victim, elements=16 << 20, config=HIERARCHICAL, transport=mixed_hosts(3, 1))
    for msg in errors.values():
        assert msg[4]["op"] == "allreduce", msg[4]
        assert "hierarchical" in msg[2], msg[2]


@pytest.mark.slow
def test_sigstop_in_a_hierarchical_allreduce_fires_the_deadline():
    n, timeout = 4, 1.0
    config = elastic.CommConfig(timeout=timeout, algorithm="hierarchical")
    with World(n, allreduce_forever(16 << 20), config=config, transport=mixed_hosts(2, 2)) as w:
        w.wait_formed()
        for r in range(n):
            w.expect(r, "running", timeout=120)
        stopped_at = w.kill(1, signal.SIGSTOP)
        reasons = set()
        for r in (0, 2, 3):
            msg = w.expect(r, "error", timeout=timeout + 10)
            assert msg[1] == "WorkerLostError", msg[2]
            assert msg[5] - stopped_at < timeout + 1.0, f"rank {r} waited {msg[5] - stopped_at:.2f} s"
            reasons.add(msg[4]["reason"])
        assert "timeout" in reasons and reasons <= {"timeout", "propagated", "peer_lost"}
