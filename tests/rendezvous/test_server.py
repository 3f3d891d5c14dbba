"""The gRPC service on loopback, against MemoryStore and a real etcd: membership behaviours end to end."""
from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest

from rdzv_helpers import make_client, unique, wait_until, wait_world_of
from rendezvous._proto import rendezvous_pb2 as pb
from rendezvous._proto import rendezvous_pb2_grpc as pb_grpc
from rendezvous.client import (Abort, Ended, Finished, JobSpec, Pending, RendezvousError, Standby,
                               WorldInfo)


def next_of(client, kind, timeout_s=5.0):
    """The next event of type `kind` (others skipped), failing after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        ev = client.next_event(deadline - time.monotonic())
        if ev is None:
            raise AssertionError(f"{client.worker_id}: no {kind.__name__} within {timeout_s} s")
        if isinstance(ev, kind):
            return ev


def stub(server):
    return pb_grpc.RendezvousStub(grpc.insecure_channel(server.address))


def test_joined_workers_get_one_world_with_ranks(serve):
    s = serve()
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job, host=f"h{i % 2}") for i in range(4)]
    for c in cs:
        c.join()
    worlds = wait_world_of(cs, 4)
    assert worlds[0].version == 1
    assert [m.host for m in worlds[0].members] == ["h0", "h0", "h1", "h1"]
    assert {(w.rank, w.local_rank, w.cross_rank) for w in worlds} == {(0, 0, 0), (1, 1, 0),
                                                                       (2, 0, 1), (3, 1, 1)}
    for c in cs:
        c.close()


def test_broken_stream_evicts_and_announces_next_world_promptly(serve):
    # The 0.3 s budget (settle 0.2 s included) is measured by bench/rendezvous_scale.py; here the
    # waits only carry a deadline with headroom for a loaded CI machine.
    s = serve(settle_s=0.2)
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job) for i in range(3)]
    for c in cs:
        c.join()
    wait_world_of(cs, 3)
    cs[1].close()                          # the stream breaks as on a crash (no Leave)
    abort = next_of(cs[0], Abort, timeout_s=1.0)
    world = next_of(cs[0], WorldInfo, timeout_s=1.0)
    assert abort.world_version == 1 and "watch stream broken" in abort.reason
    assert [m.worker_id for m in world.members] == ["w0", "w2"] and world.version == 2
    cs[0].close()
    cs[2].close()


def test_clean_leave_is_pending_change_not_abort(serve):
    s = serve()
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job) for i in range(3)]
    for c in cs:
        c.join()
    wait_world_of(cs, 3)
    cs[2].leave()
    pending = next_of(cs[0], Pending)
    assert pending.world_version == 1 and "left" in pending.reason
    events = []
    while True:
        ev = cs[0].next_event(5.0)
        events.append(ev)
        if isinstance(ev, WorldInfo) or ev is None:
            break
    assert not any(isinstance(e, Abort) for e in events)
    assert events[-1].version == 2 and events[-1].size == 2
    cs[0].close()
    cs[1].close()


def test_hot_spare_replaces_failed_member(serve):
    s = serve()
    job = unique("job")
    spec = JobSpec(min_np=2, max_np=2)
    cs = [make_client(s.address, f"w{i}", job_id=job, spec=spec) for i in range(2)]
    for c in cs:
        c.join()
    wait_world_of(cs, 2)
    spare = make_client(s.address, "spare", job_id=job, spec=spec)
    spare.join()
    assert next_of(spare, Standby).reason == "beyond max_np: hot spare"
    cs[0].close()
    worlds = wait_world_of([cs[1], spare], 2, min_version=2)
    assert [m.worker_id for m in worlds[0].members] == ["w1", "spare"]
    cs[1].close()
    spare.close()


def test_simultaneous_joins_become_one_world(serve):
    s = serve(settle_s=0.3)
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda c: c.join(), cs))
    worlds = wait_world_of(cs, 6)
    assert worlds[0].version == 1
    for c in cs:
        c.close()


def test_highest_committed_step_becomes_rank_zero_of_next_world(serve):
    s = serve()
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job) for i in range(3)]
    for c in cs:
        c.join()
    wait_world_of(cs, 3)
    cs[2].heartbeat(committed_step=40)
    cs[1].heartbeat(committed_step=30)
    cs[0].close()
    worlds = wait_world_of(cs[1:], 2, min_version=2)
    assert [m.worker_id for m in worlds[0].members] == ["w2", "w1"]
    cs[1].close()
    cs[2].close()


def test_report_failure_evicts_suspect_without_stream_at_once(serve):
    s = serve(heartbeat_timeout_s=30.0)
    job = unique("job")
    a = make_client(s.address, "a", job_id=job)
    a.join()
    raw = stub(s)  # joins but never opens a Watch: looks alive until someone reports it
    raw.Join(pb.JoinRequest(job_id=job, worker_id="b", host="h", ring_address="127.0.0.1:5",
                            committed_step=-1), timeout=5)
    world = wait_until(lambda: a.world if a.world and a.world.size == 2 else None, 5.0, "2-world")
    # heartbeat_timeout is 30 s: only the report can explain an eviction within these deadlines.
    assert a.report_failure("b", world.version, "connection refused") is True
    assert next_of(a, Abort, timeout_s=2.0).world_version == world.version
    assert next_of(a, WorldInfo, timeout_s=2.0).size == 1
    a.close()


def test_report_failure_of_live_peer_is_refuted_by_probe(serve):
    s = serve()
    job = unique("job")
    a, b = (make_client(s.address, w, job_id=job) for w in "ab")
    a.join()
    b.join()
    w = wait_world_of([a, b], 2)[0]
    assert a.report_failure("b", w.version, "timeout") is False
    assert a.report_failure("b", w.version - 1, "old") is False     # stale version ignored
    assert s.service.jobs[job].state.version == w.version
    a.close()
    b.close()


def test_repeatedly_failing_host_is_blacklisted(serve):
    s = serve(blacklist_after=1, cooldown_min_s=30.0)
    job = unique("job")
    good = make_client(s.address, "good", job_id=job, host="good")
    bad = make_client(s.address, "bad", job_id=job, host="bad")
    good.join()
    bad.join()
    wait_world_of([good, bad], 2)
    bad.close()
    next_of(good, Abort)
    again = make_client(s.address, "bad2", job_id=job, host="bad")
    with pytest.raises(RendezvousError) as e:
        again.join()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "blacklisted" in str(e.value)
    status = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5)
    assert list(status.jobs[0].blacklisted_hosts) == ["bad"]
    good.close()
    again.close()


def test_below_min_np_fails_job_after_elastic_timeout(serve):
    s = serve()
    job = unique("job")
    spec = JobSpec(min_np=2, max_np=2, elastic_timeout_s=0.5)
    a, b = (make_client(s.address, w, job_id=job, spec=spec) for w in "ab")
    a.join()
    b.join()
    wait_world_of([a, b], 2)
    b.close()
    fin = next_of(a, Finished, timeout_s=5.0)
    assert not fin.succeeded and "below min_np=2" in fin.reason
    a.close()


def test_success_of_one_worker_finishes_job_for_all(serve):
    s = serve()
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job) for i in range(3)]
    for c in cs:
        c.join()
    wait_world_of(cs, 3)
    cs[1].report_success()
    for c in cs:
        fin = next_of(c, Finished)
        assert fin.succeeded and "w1" in fin.reason
    late = make_client(s.address, "late", job_id=job)
    with pytest.raises(RendezvousError, match="already finished"):
        late.join()
    for c in cs + [late]:
        c.close()


def test_evicted_worker_learns_its_session_ended(serve):
    s = serve()
    job = unique("job")
    a, b = (make_client(s.address, w, job_id=job) for w in "ab")
    a.join()
    b.join()
    wait_world_of([a, b], 2)
    assert a.report_failure("b", 1) is False  # b is alive; now make the server evict it anyway:
    s.call(_evict(s, job, "b"))
    ended = next_of(b, Ended)
    assert ended.reason.startswith("NOT_FOUND") and "evicted" in ended.reason
    a.close()
    b.close()


async def _evict(s, job, worker):
    svc = s.service
    svc._evict(svc.jobs[job], worker, "test eviction")


def test_status_lists_jobs_members_and_ranks(serve):
    from rendezvous.cli import format_status

    s = serve()
    job = unique("job")
    cs = [make_client(s.address, f"w{i}", job_id=job, host="node") for i in range(2)]
    for c in cs:
        c.join()
    wait_world_of(cs, 2)
    resp = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5)
    (j,) = resp.jobs
    assert j.phase == "RUNNING" and j.world_version == 1
    assert [(m.member.worker_id, m.member.rank, m.attached) for m in j.members] == [
        ("w0", 0, True), ("w1", 1, True)]
    table = format_status(resp)
    assert f"job {job}  phase RUNNING  world 1" in table and "w1" in table
    for c in cs:
        c.close()


def test_64_concurrent_clients_agree_on_one_world(serve):
    s = serve(settle_s=0.2)
    job = unique("job")
    cs = [make_client(s.address, f"w{i:02d}", job_id=job, host=f"h{i // 8}",
                      spec=JobSpec(min_np=64, max_np=64)) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda c: c.join(), cs))
    worlds = wait_world_of(cs, 64, timeout_s=20.0)
    assert worlds[0].version == 1
    assert all(w.local_size == 8 and w.cross_size == 8 for w in worlds)
    for c in cs:
        c.close()


def test_finished_job_is_forgotten_after_retention_and_its_id_reusable(serve):
    s = serve(finished_job_retention_s=0.3)
    job = unique("job")
    a = make_client(s.address, "a", job_id=job)
    a.join()
    wait_world_of([a], 1)
    a.report_success()
    assert next_of(a, Finished).succeeded
    assert stub(s).Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0].phase == "SUCCEEDED"

    def forgotten():
        try:
            stub(s).Status(pb.StatusRequest(job_id=job), timeout=5)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND
        return False
    wait_until(forgotten, 5.0, f"job {job} to be forgotten")
    again = make_client(s.address, "b", job_id=job)
    again.join()
    assert wait_world_of([again], 1)[0].version == 1   # a fresh job under the same id
    a.close()
    again.close()
