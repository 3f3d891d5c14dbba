"""`serve --events FILE` and Status's recent events: what happened to a job, in order, and only to
the job's own token."""
from __future__ import annotations

import json
import signal

import grpc
import pytest

from rendezvous.server import decision as d
from rendezvous.wire.messages import pb, pb_grpc
from rendezvous.wire.membership import JobSpec
from rendezvous.client.status_client import StatusClient
from rendezvous.common.event_log import EVENTS, EventLog
from rendezvous.server.description import describe
from rendezvous.server.history import RECENT_PER_JOB
from rendezvous.server.store import MemoryStore

from .rdzv_helpers import (REPO, ServerProc, ServerThread, WorkerProc, child_env, make_client, server_config, unique,
                           wait_until)


def read_events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


M = (d.Member("a", "h1", "h1:1", 0, 0, 1, 0, 2, 5), d.Member("b", "h2", "h2:1", 1, 0, 1, 1, 2, 5))


@pytest.mark.parametrize("action, event, worker, fields", [
    (d.AnnounceWorld(3, M, ("c",)), "world_formed", "",
     {"size": 2, "standby": 1, "members": [{"worker_id": "a", "rank": 0, "host": "h1"},
                                           {"worker_id": "b", "rank": 1, "host": "h2"}]}),
    (d.Dropped("b", "worker b left"), "worker_left", "b", {"reason": "worker b left"}),
    (d.Dropped("b", "worker b left as a straggler", d.Departure.STRAGGLER), "straggler_left", "b",
     {"reason": "worker b left as a straggler"}),
    (d.Dropped("b", "watch stream broken", d.Departure.STREAM_BROKEN), "worker_evicted", "b",
     {"cause": "stream_broken", "reason": "watch stream broken"}),
    (d.Dropped("b", "rejoined", d.Departure.REJOINED), "worker_evicted", "b",
     {"cause": "session_replaced", "reason": "rejoined"}),
    (d.Dropped("b", "evil\x1b[2J\nline", d.Departure.REPORTED), "worker_evicted", "b",
     {"cause": "report", "reason": "evil\\x1b[2J\\nline"}),      # peer text escaped
    (d.AnnounceFinished(True, "worker a reported success"), "job_finished", "",
     {"outcome": "succeeded", "reason": "worker a reported success"}),
    (d.AnnounceAbort(3, "x"), None, None, None),                 # no event of its own
    (d.AnnouncePending(3, "x"), None, None, None),
])
def test_each_delivered_action_is_one_event_or_none(action, event, worker, fields):
    got = describe(action, 3)
    if event is None:
        assert got.event is None
        return
    assert (got.event, got.worker_id, dict(got.fields)) == (event, worker, fields)
    assert got.event in EVENTS and got.detail and "\x1b" not in got.detail


@pytest.mark.slow
def test_event_log_of_join_kill_reform_finish_has_exactly_those_events_in_order(tmp_path):
    path = tmp_path / "events.jsonl"
    s = ServerThread(server_config(events_path=str(path)), MemoryStore)
    job = unique("job")
    procs, lead = [], None
    try:
        # w1 and w2 form world 1; w0 (this process) joins it (world 2); w1 is SIGKILLed (world 3);
        # w0 and w2 report success (the job is the world's: every member returns).
        procs.append(WorkerProc([s.address], job, "w1", min_np=2, max_np=3))
        procs[0].wait_event(lambda e: e["event"] == "joined", 10.0, "w1 joined")
        procs.append(WorkerProc([s.address], job, "w2", min_np=2, max_np=3))
        w2_session = procs[1].wait_event(lambda e: e["event"] == "joined", 10.0, "w2 joined")["session"]
        procs[0].world(1)
        lead = make_client(s.address, "w0", job_id=job, spec=JobSpec(min_np=2, max_np=3))
        lead.join()
        lead.wait_world(timeout_s=10.0, min_version=2)
        procs[0].kill(signal.SIGKILL)
        w3 = lead.wait_world(timeout_s=10.0, min_version=3)
        assert sorted(m.worker_id for m in w3.peers) == ["w0", "w2"]
        assert lead.report_success(w3.world_version, commit_step=5) is False   # w2 has not returned yet
        with grpc.insecure_channel(s.address) as ch:   # w2's report, with w2's session
            done = pb_grpc.RendezvousStub(ch).ReportSuccess(
                pb.ReportSuccessRequest(session_id=w2_session, world_version=w3.world_version, commit_step=5),
                timeout=10)
        assert done.finished
        procs[1].wait_event(lambda e: e["event"] == "finished", 10.0, "w2 told the job finished")
    finally:
        if lead is not None:
            lead.close()
        for p in procs:
            p.kill()
        s.stop()
    events = read_events(path)
    assert [(e["event"], e.get("worker_id", "")) for e in events] == [
        ("server_started", ""), ("leader_elected", ""),
        ("job_created", ""), ("worker_joined", "w1"), ("worker_joined", "w2"),
        ("world_formed", ""),
        ("worker_joined", "w0"), ("world_formed", ""),
        ("worker_evicted", "w1"), ("world_formed", ""),
        ("job_finished", ""),
        ("server_stopped", ""),
    ]
    by_job = [e for e in events if "job_id" in e]
    assert {e["job_id"] for e in by_job} == {job}
    worlds = [e for e in by_job if e["event"] == "world_formed"]
    assert [e["world_version"] for e in worlds] == [1, 2, 3]
    assert [[m["worker_id"] for m in e["members"]] for e in worlds] == [
        ["w1", "w2"], ["w1", "w2", "w0"], ["w2", "w0"]]
    assert [m["rank"] for m in worlds[2]["members"]] == [0, 1]
    (evicted,) = [e for e in by_job if e["event"] == "worker_evicted"]
    assert evicted["cause"] == "stream_broken" and "watch stream broken" in evicted["reason"]
    assert evicted["world_version"] == 2
    (finished,) = [e for e in by_job if e["event"] == "job_finished"]
    assert finished["outcome"] == "succeeded" and finished["world_version"] == 3
    times = [e["time"] for e in events]
    assert times == sorted(times) and all(e["ts"].endswith("Z") for e in events)


def test_status_returns_recent_events_only_of_the_callers_own_jobs():
    s = ServerThread(server_config(insecure=False, tokens=("tok-a", "tok-b")), MemoryStore)
    clients = []
    try:
        jobs = {}
        for token in ("tok-a", "tok-b"):
            jobs[token] = unique("job")
            c = make_client(s.address, "w", job_id=jobs[token], token=token)
            clients.append(c)
            c.join()
            c.wait_world(timeout_s=10.0)
        for token in ("tok-a", "tok-b"):
            with StatusClient([s.address], token) as st:
                answer = st.status(events=RECENT_PER_JOB + 10)   # more than kept: capped
                assert [j.job_id for j in answer.jobs] == [jobs[token]]
                assert [e.event for e in answer.jobs[0].events] == [
                    "job_created", "worker_joined", "world_formed"]
                assert answer.jobs[0].events[1].worker_id == "w"
                assert st.status().jobs[0].events == ()           # none unless asked for
    finally:
        for c in clients:
            c.close()
        s.stop()


def test_recent_events_are_bounded_per_job():
    s = ServerThread(server_config(settle_s=0.01), MemoryStore)
    job = unique("job")
    c = make_client(s.address, "w0", job_id=job)
    try:
        c.join()
        c.wait_world(timeout_s=10.0)
        for i in range(30):   # a join and a leave each: 60 events and more
            other = make_client(s.address, f"x{i}", job_id=job)
            other.join()
            other.leave()
            other.close()
        with StatusClient([s.address]) as st:
            # (A re-announced world may follow the last leave.)
            got = wait_until(lambda: (evs := st.status(job, events=RECENT_PER_JOB).jobs[0].events)
                             and ("worker_left", "x29") in [(e.event, e.worker_id) for e in evs]
                             and evs, 10.0, "the last leave recorded")
        assert len(got) == RECENT_PER_JOB
        assert got[0].event != "job_created"        # the oldest ones were dropped
    finally:
        c.close()
        s.stop()


def test_serve_with_an_events_file_it_cannot_open_says_so_in_one_line(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "no-such-dir" / "events.jsonl"
    done = subprocess.run([sys.executable, "-m", "rendezvous", "serve", "--insecure", "--port", "0",
                           "--events", str(path)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"elastic-rendezvous: --events {path}: cannot open for appending: No such file or directory"]


def test_an_events_path_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path):
    # In a shared directory another user's link would get these lines appended to its target.
    target = tmp_path / "someone-elses-file"
    target.write_text("theirs\n")
    link = tmp_path / "events.jsonl"
    link.symlink_to(target)
    with pytest.raises(ValueError, match=r"--events .*events.jsonl: cannot open for appending: it is a symbolic link"):
        EventLog(str(link))
    assert target.read_text() == "theirs\n"


def test_a_served_process_writes_its_start_and_graceful_stop(tmp_path):
    path = tmp_path / "events.jsonl"
    s = ServerProc(tmp_path, "--insecure", "--events", str(path))
    try:
        wait_until(lambda: path.exists() and len(read_events(path)) >= 2, 10.0, "start and leader")
        s.signal(signal.SIGTERM)
        assert s.wait(10) == 0
    finally:
        s.kill()
    events = read_events(path)
    assert [e["event"] for e in events] == ["server_started", "leader_elected", "server_stopped"]
    assert events[0]["store"] == "memory" and events[0]["address"].startswith("127.0.0.1:")
    assert len({e["replica_id"] for e in events}) == 1


def test_recent_events_go_only_to_the_owner_they_were_recorded_for():
    from rendezvous.server.history import History

    h = History()
    mine = d.new_job("j", d.JobSpec(1, 8, 60.0), 0.0, credential="cred-a")
    h.job(mine, "job_created")
    h.job(mine, "worker_joined", worker_id="w")
    assert [e.event for e in h.recent("j", "cred-a", 10)] == ["job_created", "worker_joined"]
    assert h.recent("j", "cred-a", 1)[0].event == "worker_joined"      # the newest n
    assert h.recent("j", "cred-b", 10) == [] and h.recent("j", "cred-a", 0) == []
    # The id forgotten and taken by another token: its history starts empty.
    theirs = d.new_job("j", d.JobSpec(1, 8, 60.0), 0.0, credential="cred-b")
    h.job(theirs, "job_created")
    assert [e.event for e in h.recent("j", "cred-b", 10)] == ["job_created"]
    assert h.recent("j", "cred-a", 10) == []
    h.forget()
    assert h.recent("j", "cred-b", 10) == []
