"""One member cannot decide for the world at a commit: real server, real worker processes
(tests/elastic/job.py), two honest workers and one hostile member that forges its row of the
commits' membership check (JOB_EVIL_ROW). Each rank writes only its own row; what no honest worker
writes is blamed, a change is taken only when the majority saw the server announce it, and a
leave only when the leaver leaves. The honest workers finish with identical state and the
hostile member is evicted by their reports, never by one of them alone."""

from __future__ import annotations

import json
import os
import time

import pytest

from elastic.state import checkpoint
from tests.chaos.checks import EPOCHS, check_accounting, check_identical
from tests.rendezvous.rdzv_helpers import ServerProc

from .jobs import Job

pytestmark = pytest.mark.slow   # real processes and servers: not in the fast lane

HONEST = ["w0", "w1"]


@pytest.fixture
def events_server(tmp_path):
    events = tmp_path / "events.jsonl"
    srv = ServerProc(tmp_path, "--insecure", "--heartbeat-timeout", "2", "--settle", "0.2", "--events", str(events))
    srv.events_path = str(events)
    yield srv
    srv.kill()


def server_events(server) -> list:
    if not os.path.exists(server.events_path):
        return []
    with open(server.events_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_with_hostile(tmp_path, server, evil_row, final_size=2, **env):
    """w0 and w1 train with a hostile member on a host of its own; returns (job, honest results)."""
    # Long enough (about 60 steps of 0.2 s) for a claim's grace to pass while they train.
    job = Job(tmp_path, server.address, min_np=2, max_np=3, **{"JOB_STEP_SLEEP": "0.2", "JOB_SAMPLES": "480", **env})
    try:
        for w in HONEST:
            job.start(w)
        job.start("evil", JOB_EVIL_ROW=evil_row, ELASTIC_HOST="badhost")
        codes = job.wait(HONEST, timeout=240)
        assert codes == {w: 0 for w in HONEST}, job.log("w0") + job.log("w1")
        results = [job.result(w) for w in HONEST]
        check_identical(results)
        check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
        assert all(r["final_size"] == final_size for r in results)
        return job, results
    finally:
        job.close()


def evictions(server, worker_id: str) -> list:
    return [e for e in server_events(server) if e.get("event") == "worker_evicted" and e.get("worker_id") == worker_id]


@pytest.mark.parametrize("evil_row, cause, says", [
    ("pending", "blamed", "claimed a membership change of world version"),
    ("timings", "blamed", "wrote 1e+03 s of computing and waiting"),
    ("leave", "blamed", "said at a commit of world version"),
], ids=["forged-pending", "impossible-timings", "leave-not-taken"])
def test_a_member_forging_its_row_of_the_membership_check_is_evicted_and_the_honest_finish(tmp_path, events_server,
                                                                                          evil_row, cause, says):
    job, _ = run_with_hostile(tmp_path, events_server, evil_row)
    evicted = evictions(events_server, "evil")
    assert evicted and evicted[0]["cause"] == cause, server_events(events_server)
    assert "reported by 2 of the 2 other member(s)" in evicted[0]["reason"], evicted
    logs = job.log("w0") + job.log("w1")
    assert says in logs, logs
    assert "Traceback" not in logs and "ElasticTimeout" not in logs, logs
    # Nobody honest was evicted, nor named a straggler.
    assert not evictions(events_server, "w0") and not evictions(events_server, "w1")


def test_a_member_claiming_it_never_computes_does_not_make_an_honest_rank_a_straggler(tmp_path, events_server):
    # The old attack wrote 1000 s into an honest rank's slot of a Max allreduce; now a member can
    # only lie about itself, and in a world of three the median is an honest rank's.
    job, results = run_with_hostile(
        tmp_path, events_server, "fast", final_size=3, ELASTIC_STRAGGLER_POLICY="evict",
        ELASTIC_STRAGGLER_WINDOW="0.3")
    logs = job.log("w0") + job.log("w1")
    assert "is a straggler" not in logs, logs
    assert not [e for e in server_events(events_server) if e.get("event", "").startswith("straggler")]


def test_a_member_whose_function_returns_early_leaves_and_the_others_train_on(tmp_path, events_server):
    # Its success is not the world's: it leaves gracefully (not evicted, its host not
    # blacklisted), the others finish every epoch and the job succeeds when they return.
    job = Job(tmp_path, events_server.address, min_np=2, max_np=3, JOB_STEP_SLEEP="0.1", JOB_SAMPLES="480",
              JOB_RETURN_AT="early:12")
    try:
        for w in HONEST:
            job.start(w)
        job.start("early", ELASTIC_HOST="otherhost")
        codes = job.wait(HONEST + ["early"], timeout=240)
        assert codes == {w: 0 for w in HONEST + ["early"]}, job.log("w0") + job.log("w1") + job.log("early")
        results = [job.result(w) for w in HONEST]
        check_identical(results)
        check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
        assert all(r["final_size"] == 2 and r["epochs"] == EPOCHS for r in results)
        assert job.result("early")["step"] < results[0]["step"]
        assert "while the others train on" in job.log("early") and "it leaves the world" in job.log("early")
    finally:
        job.close()
    events = server_events(events_server)
    assert not evictions(events_server, "early") and not evictions(events_server, "w0"), events
    assert [e for e in events if e.get("event") == "worker_left" and e.get("worker_id") == "early"], events
    (finished,) = [e for e in events if e.get("event") == "job_finished"]
    assert finished["outcome"] == "succeeded" and "every member of world" in finished["reason"], finished
    assert "early" not in finished["reason"]


def test_every_member_returning_at_the_same_commit_completes_the_job_with_no_extra_world(tmp_path, events_server):
    job = Job(tmp_path, events_server.address, min_np=3, max_np=3)
    try:
        for w in ["w0", "w1", "w2"]:
            job.start(w)
        assert job.wait(["w0", "w1", "w2"], timeout=120) == {"w0": 0, "w1": 0, "w2": 0}
        check_identical([job.result(w) for w in ["w0", "w1", "w2"]])
    finally:
        job.close()
    events = server_events(events_server)
    worlds = [e for e in events if e.get("event") == "world_formed"]
    (finished,) = [e for e in events if e.get("event") == "job_finished"]
    assert len(worlds) == 1 and finished["outcome"] == "succeeded", events
    assert f"every member of world {worlds[0]['world_version']} returned" in finished["reason"]
    assert "(w0, w1, w2)" in finished["reason"]


def test_a_joiner_with_other_ring_settings_in_a_world_of_three_is_evicted_by_the_majority(tmp_path, events_server):
    # The majority's settings win: w0 and w1 blame the odd member (DIVERGED), it ends with
    # SettingsMismatchError, and they go on in a world of two.
    job = Job(tmp_path, events_server.address, min_np=2, max_np=3, JOB_STEP_SLEEP="0.1", JOB_SAMPLES="480")
    try:
        for w in HONEST:
            job.start(w)
        job.wait_step(3, HONEST)   # their world of two trains: the odd one joins it, a world of three
        job.start("odd", ELASTIC_SEGMENT_BYTES=str(64 << 10), ELASTIC_HOST="oddhost")
        codes = job.wait(HONEST + ["odd"], timeout=240)
        assert codes["w0"] == codes["w1"] == 0 and codes["odd"] != 0, codes
        results = [job.result(w) for w in HONEST]
        check_identical(results)
        check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
        assert all(r["final_size"] == 2 for r in results)
        logs = job.log("w0") + job.log("w1")
        assert "ring setting segment_bytes (ELASTIC_SEGMENT_BYTES) differs" in logs, logs
        assert "differs from the majority of the world" in logs, logs
        assert "this rank differs from the majority of the world and leaves it" in job.log("odd"), job.log("odd")
    finally:
        job.close()
    assert evictions(events_server, "odd") and not evictions(events_server, "w0") \
        and not evictions(events_server, "w1"), server_events(events_server)


def test_a_member_that_skips_the_final_barrier_is_named_and_the_others_are_released_within_the_bound(tmp_path,
                                                                                                   events_server):
    # After the run nobody watches the members: each collective on the kept ring waits at most
    # ELASTIC_AFTER_RUN_TIMEOUT (2 s here; the collective timeout is 20 s) for every member.
    # The honest workers' dist.barrier() raises, as torch's does on its timeout, naming the
    # member; the job had completed, and its last commit is on disk.
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, events_server.address, min_np=3, max_np=3, JOB_CHECKPOINT=str(ckpt),
              JOB_FINAL_BARRIER="skipper:60", ELASTIC_AFTER_RUN_TIMEOUT="2")
    try:
        for w in HONEST + ["skipper"]:
            job.start(w)
        codes = job.wait(HONEST, timeout=180)
        exited = time.time()
        logs = {w: job.log(w) for w in HONEST}
        assert codes == {"w0": 1, "w1": 1}, logs
        assert job.procs["skipper"].poll() is None, "the member that skipped the barrier still sleeps"
        entered = max(next(e["t"] for e in job.events(w) if e["ev"] == "final_barrier") for w in HONEST)
        assert exited - entered < 12, f"released {exited - entered:.1f} s after the barrier, not within the bound"
        assert not any(e["ev"] == "final_barrier_passed" for w in HONEST for e in job.events(w))
        rank = next(r for r in range(3) if f"worker skipper (rank {r})" in logs["w0"] + logs["w1"])
        named = [w for w in HONEST
                 if f"worker skipper (rank {rank}) did not arrive at barrier within 2 s (ELASTIC_AFTER_RUN_TIMEOUT)"
                 in logs[w]]
        # The rank after it waited on it and names it; the other was told of a failure further on.
        assert len(named) == 1, logs
        (other,) = set(HONEST) - set(named)
        assert "gave up on it because of a failure further round the ring" in logs[other], logs[other]
        results = [job.result(w) for w in HONEST + ["skipper"]]
        check_identical(results)
    finally:
        job.close()
    assert checkpoint.read_latest(str(ckpt))[0] == results[0]["commit_step"], "the last commit is on disk"
    (finished,) = [e for e in server_events(events_server) if e.get("event") == "job_finished"]
    assert finished["outcome"] == "succeeded", finished


def test_a_member_calling_another_collective_once_in_a_world_of_three_is_evicted_by_the_majority(tmp_path,
                                                                                                 events_server):
    # "odd" allreduces one element more than the others, once (a data-dependent branch). The ring
    # fails on every rank; the world forms again and its sync compares what each rank called: w0
    # and w1 called the same and blame it (DIVERGED), it ends outvoted, they train on as two.
    job = Job(tmp_path, events_server.address, min_np=2, max_np=3, JOB_STEP_SLEEP="0.1", JOB_SAMPLES="480",
              JOB_DIVERGE="odd:20")
    try:
        for w in HONEST:
            job.start(w)
        job.wait_step(3, HONEST)
        job.start("odd", ELASTIC_HOST="oddhost")
        codes = job.wait(HONEST + ["odd"], timeout=240)
        assert codes["w0"] == codes["w1"] == 0 and codes["odd"] != 0, codes
        results = [job.result(w) for w in HONEST]
        check_identical(results)
        check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
        assert all(r["final_size"] == 2 and r["epochs"] == EPOCHS for r in results)
        logs = job.log("w0") + job.log("w1")
        assert "the world is formed again and its members compare what they called" in logs, logs
        assert "called allreduce #" in logs and "(float64, 481 elements, sum) where the majority of the world " \
               "called allreduce #" in logs, logs
        odd = job.log("odd")
        assert "it differs from the majority of the world and leaves it" in odd, odd
        assert "Traceback" not in logs and "ElasticTimeout" not in logs, logs
    finally:
        job.close()
    # Evicted by the majority's reports, or, as it ends at once, for its stream (both count against its host).
    evicted = evictions(events_server, "odd")
    assert evicted and evicted[0]["cause"] in ("diverged", "stream_broken"), server_events(events_server)
    assert not evictions(events_server, "w0") and not evictions(events_server, "w1")


def test_two_members_calling_different_collectives_have_no_majority_and_both_stop_naming_each_call(
        tmp_path, events_server):
    job = Job(tmp_path, events_server.address, min_np=2, max_np=2, JOB_STEP_SLEEP="0.05", JOB_DIVERGE="w1:6")
    try:
        for w in HONEST:
            job.start(w)
        codes = job.wait(HONEST, timeout=120)
        assert codes["w0"] != 0 and codes["w1"] != 0, codes
        for w in HONEST:
            said = [line for line in job.log(w).splitlines() if "no call is the majority's" in line]
            assert said, job.log(w)
            assert "(float64, 240 elements, sum)" in said[-1] and "(float64, 241 elements, sum)" in said[-1], said
            assert "rank 0" in said[-1] and "rank 1" in said[-1], said
    finally:
        job.close()
