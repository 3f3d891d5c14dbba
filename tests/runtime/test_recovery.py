"""elastic.run on real processes: failures restore, joins keep, every rank ends bit-identical."""

from __future__ import annotations

import signal
import time

import pytest

from .jobs import wait_until

EPOCHS, SAMPLES = 3, 240


def check_accounting(results, max_repartitions):
    """Every sample of every epoch was trained on; repeats only from padding."""
    for r in results:
        seen = r["seen"]
        assert min(seen) >= EPOCHS, f"{r['worker']}: a sample was skipped ({min(seen)} < {EPOCHS})"
        extra = sum(seen) - EPOCHS * SAMPLES
        assert 0 <= extra <= max_repartitions, f"{r['worker']}: {extra} repeats > padding bound {max_repartitions}"


def check_identical(results):
    hashes = {r["worker"]: r["hash"] for r in results}
    assert len(set(hashes.values())) == 1, f"replicas differ: {hashes}"


def test_fault_free_job_completes_identically(job_factory):
    job = job_factory(min_np=3, max_np=3)
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    assert job.wait(workers) == {w: 0 for w in workers}
    results = [job.result(w) for w in workers]
    check_identical(results)
    check_accounting(results, max_repartitions=EPOCHS * 2)
    assert all(r["restores"] == 0 for r in results)


@pytest.mark.parametrize("victim", ["w1", "w0"], ids=["peer", "rank0"])
def test_peer_sigkilled_mid_step_survivors_restore_and_finish_identical(job_factory, victim):
    job = job_factory(min_np=2, max_np=3)
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    job.wait_step(8, workers)
    job.kill(victim, signal.SIGKILL)
    survivors = [w for w in workers if w != victim]
    assert job.wait(survivors) == {w: 0 for w in survivors}
    results = [job.result(w) for w in survivors]
    check_identical(results)
    # Size 3 -> 2: at most 2 padding repeats per partition, a few partitions.
    check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
    for r in results:
        assert r["restores"] >= 1, "WorkerLostError must restore"
        assert r["resets"][-1]["size"] == 2, "reset callbacks must see the new size"
        assert abs(r["lr"] - 0.05 * 2 / 3) < 1e-12, "the callback's learning rate must survive the sync"


def test_two_peers_killed_at_once(job_factory):
    job = job_factory(min_np=2, max_np=4)
    workers = ["w0", "w1", "w2", "w3"]
    for w in workers:
        job.start(w)
    job.wait_step(6, workers)
    job.kill("w1")
    job.kill("w2")
    survivors = ["w0", "w3"]
    assert job.wait(survivors) == {w: 0 for w in survivors}
    results = [job.result(w) for w in survivors]
    check_identical(results)
    check_accounting(results, max_repartitions=3 * (EPOCHS + 2))


@pytest.mark.parametrize("where", ["commit", "sync"])
def test_peer_dying_mid_commit_or_mid_sync(job_factory, where):
    job = job_factory(min_np=2, max_np=4)
    workers = ["w0", "w1", "w2", "w3"]
    for w in ["w0", "w1", "w2"]:
        job.start(w)
    # w3 kills itself inside commit 2, or inside its second sync (the one after a failure).
    job.start("w3", JOB_DIE_IN=where, JOB_DIE_AT=2 if where == "commit" else 1)
    if where == "sync":
        job.wait_step(5, workers)
        job.kill("w1")  # forces a re-sync, in which w3 dies
        survivors = ["w0", "w2"]
    else:
        survivors = ["w0", "w1", "w2"]
    assert job.wait(survivors) == {w: 0 for w in survivors}
    assert job.procs["w3"].wait(5) == -signal.SIGKILL
    results = [job.result(w) for w in survivors]
    check_identical(results)
    check_accounting(results, max_repartitions=4 * (EPOCHS + 3))


def test_worker_joining_receives_state_and_world_grows_at_one_step(job_factory):
    job = job_factory(min_np=2, max_np=3, JOB_STEP_SLEEP="0.2")  # ~9 s: the newcomer arrives mid-run
    for w in ["w0", "w1"]:
        job.start(w)
    job.wait_step(5, ["w0", "w1"])
    job.start("w2")
    workers = ["w0", "w1", "w2"]
    assert job.wait(workers) == {w: 0 for w in workers}
    results = [job.result(w) for w in workers]
    check_identical(results)
    check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
    old = [r for r in results if r["worker"] != "w2"]
    # Both old members switched at the same commit, and never restored (a join keeps the state).
    assert old[0]["commits_at_change"] == old[1]["commits_at_change"] != []
    assert all(r["restores"] == 0 for r in old)
    assert all(r["resets"][-1]["size"] == 3 for r in old), "reset callbacks must see the new size"
    assert all(r["final_size"] == 3 for r in results)


def test_deterministic_user_exception_ends_every_worker_with_its_traceback(job_factory):
    job = job_factory(min_np=2, max_np=2, JOB_RAISE_AT="7")
    workers = ["w0", "w1"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=60)
    for w in workers:
        assert codes[w] != 0
        log = job.log(w)
        assert "ValueError: deterministic user error at step 7" in log
        assert log.count("ValueError: deterministic user error") == 1, "raised once: no restart loop"


def test_stopped_peer_is_fenced_out_by_the_abort_notice(job_factory):
    # Heartbeat timeout 2 s (server fixture); collective deadline 20 s: recovery must come
    # from the server's abort notice, not from the ring's own deadline.
    job = job_factory(min_np=2, max_np=3, JOB_STEP_SLEEP="0.05")
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    job.wait_step(6, workers)
    job.kill("w1", signal.SIGSTOP)
    stopped_at = time.monotonic()
    # The survivors' world shrinks to 2 and they step on, long before the 20 s deadline.
    wait_until(lambda: all((job.progress(w) or (0, 0))[1] == 2 for w in ("w0", "w2")), 15,
               "survivors to step in a world of 2")
    assert time.monotonic() - stopped_at < 2.0 + 3.0
    survivors = ["w0", "w2"]
    assert job.wait(survivors) == {w: 0 for w in survivors}
    results = [job.result(w) for w in survivors]
    check_identical(results)
    check_accounting(results, max_repartitions=2 * (EPOCHS + 2))


def test_after_losing_every_worker_a_relaunch_resumes_from_the_durable_commit(job_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = job_factory(job_id="first", min_np=2, max_np=2, JOB_CHECKPOINT=ckpt, JOB_STEP_SLEEP="0.1")
    for w in ["a0", "a1"]:
        first.start(w)
    first.wait_step(20, ["a0", "a1"])
    first.kill("a0")
    first.kill("a1")
    assert (ckpt / "elastic-commit.pt").exists()
    again = job_factory(job_id="again", min_np=2, max_np=2, JOB_CHECKPOINT=ckpt)
    for w in ["b0", "b1"]:
        again.start(w)
    assert again.wait(["b0", "b1"]) == {"b0": 0, "b1": 0}
    results = [again.result(w) for w in ["b0", "b1"]]
    check_identical(results)
    for r in results:
        assert r["start_commit"] >= 2 and r["start_step"] >= 6, "the relaunch must resume, not start over"
    # The counter buffer came back from disk too: every sample still counted, none lost.
    check_accounting(results, max_repartitions=2 * (EPOCHS + 2))


def test_a_live_but_stalled_peer_makes_the_ring_reform_not_wedge(job_factory):
    # w1 stalls 4 s once; the collective deadline is 1 s. Nobody died, so nobody is evicted:
    # the failure report makes the server re-announce the same members and training goes on.
    job = job_factory(min_np=3, max_np=3, ELASTIC_COLLECTIVE_TIMEOUT="1", ELASTIC_WORLD_TIMEOUT="30",
                      JOB_STALL="w1:6:4")
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    assert job.wait(workers, timeout=90) == {w: 0 for w in workers}
    results = [job.result(w) for w in workers]
    check_identical(results)
    check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
    assert all(r["final_size"] == 3 for r in results)
    assert any(r["restores"] >= 1 for r in results)
