"""elastic.run on real processes: a fault-free job, a join, a stalled peer; every rank ends bit-identical.

Faults (killed, stopped, failing workers; lost servers and links) are in tests/chaos."""

from __future__ import annotations

import os

from tests.chaos.checks import EPOCHS, check_accounting, check_identical
from tests.waiting import wait_until
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane


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


def test_worker_joining_receives_state_and_world_grows_at_one_step(job_factory, tmp_path):
    # Long enough for a newcomer that starts slowly on a loaded machine: the job ends at the first
    # epoch boundary after the newcomer has trained in the world of three.
    stop = os.path.join(str(tmp_path), "stop")
    job = job_factory(min_np=2, max_np=3, JOB_STEP_SLEEP="0.2", JOB_EPOCHS="100", JOB_STOP_FILE=stop)
    for w in ["w0", "w1"]:
        job.start(w)
    job.wait_step(5, ["w0", "w1"])
    job.start("w2")
    wait_until(lambda: (job.progress("w2") or (0, 0, 0))[1] == 3, 120, "w2 to train in the world of three")
    open(stop, "w").close()
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
    assert any(r["restores"] + r["kept"] >= 1 for r in results)   # a failure: restored, or kept live


def test_workers_with_different_ring_settings_fail_at_once_naming_the_setting(job_factory):
    job = job_factory(min_np=2, max_np=2)
    job.start("w0")
    job.start("w1", ELASTIC_HIERARCHICAL_BYTES=str(8 << 20))
    codes = job.wait(["w0", "w1"], timeout=60)
    for w in ("w0", "w1"):
        assert codes[w] != 0, job.log(w)
        log = job.log(w)
        assert ("ring setting hierarchical_bytes (ELASTIC_HIERARCHICAL_BYTES) differs between the ranks of "
                "world version 1") in log, log
        assert "4194304 on rank(s)" in log and "8388608 on rank(s)" in log, log


def test_an_allreduce_algorithm_differing_in_a_mixed_world_ends_the_job_naming_it(job_factory):
    # Hosts a, a, b: the others form a host-local and a leaders' ring, w2 (algorithm "ring")
    # forms neither, so a handshake is refused before the settings check can run.
    job = job_factory(min_np=3, max_np=3, ELASTIC_ELASTIC_TIMEOUT="5")
    job.start("w0", ELASTIC_HOST="a")
    job.start("w1", ELASTIC_HOST="a")
    job.start("w2", ELASTIC_HOST="b", ELASTIC_ALLREDUCE_ALGORITHM="ring")
    codes = job.wait(["w0", "w1", "w2"], timeout=60)
    assert all(c != 0 for c in codes.values()), codes
    logs = "".join(job.log(w) for w in ("w0", "w1", "w2"))
    assert "is ELASTIC_ALLREDUCE_ALGORITHM the same on every worker?" in logs, logs



def test_a_job_that_ends_right_after_its_first_step_tells_status_it_trained_in_its_world(job_factory, server):
    # One worker, one step, no pause: its success ends the job well within the event thread's
    # turn of 0.2 s that reports progress, so the report goes with the success, or a launcher
    # never learns the world trained (it counts a recovery to that).
    from rendezvous.client.status_client import StatusClient
    job = job_factory(min_np=1, max_np=1, JOB_EPOCHS="1", JOB_SAMPLES="8", JOB_STEP_SLEEP="0")
    job.start("w0")
    assert job.wait(["w0"]) == {"w0": 0}, job.log("w0")
    status = StatusClient([server.address])
    try:
        view = status.job("job", timeout_s=5.0)
    finally:
        status.close()
    assert view is not None and view.phase == "SUCCEEDED", view
    assert [(m.worker_id, m.stepped_world) for m in view.members] == [("w0", view.world_version)], view
