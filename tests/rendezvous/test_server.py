"""The gRPC service on loopback, against MemoryStore and a real etcd: membership behaviours end to end."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest

from rendezvous.common.channel import RendezvousRPCError
from rendezvous.wire.membership import JobSpec
from rendezvous.client.watch_events import Abort, Ended, Finished, Pending, Standby, WorldInfo
from rendezvous.wire.messages import pb

from .rdzv_helpers import ServerThread, join_world, next_of, server_config, unique, wait_until, wait_world_of


def test_joined_workers_get_one_world_with_ranks(serve, client):
    s = serve()
    job = unique("job")
    # min_np=4: no world forms before the last join, however far apart the joins land.
    cs = [client(s.address, f"w{i}", job_id=job, host=f"h{i % 2}",
                 spec=JobSpec(min_np=4, max_np=4)) for i in range(4)]
    for c in cs:
        c.join()
    worlds = wait_world_of(cs, 4)
    assert worlds[0].world_version == 1
    assert [m.host for m in worlds[0].peers] == ["h0", "h0", "h1", "h1"]
    assert {(w.rank, w.local_rank, w.cross_rank) for w in worlds} == {(0, 0, 0), (1, 1, 0),
                                                                       (2, 0, 1), (3, 1, 1)}


def test_broken_stream_evicts_and_announces_next_world_promptly(serve, client):
    # The 0.3 s budget (settle 0.2 s included) is measured by bench/rendezvous_scale.py; here the
    # waits only carry a deadline with headroom for a loaded CI machine.
    s = serve(settle_s=0.2)
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(3)]
    v = join_world(cs)
    cs[1].close()                          # the stream breaks as on a crash (no Leave)
    abort = next_of(cs[0], Abort, timeout_s=1.0)
    world = next_of(cs[0], WorldInfo, timeout_s=1.0)
    assert abort.world_version == v and "watch stream broken" in abort.reason
    assert [m.worker_id for m in world.peers] == ["w0", "w2"] and world.world_version == v + 1


def test_clean_leave_is_pending_change_not_abort(serve, client):
    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(3)]
    v = join_world(cs)
    cs[2].leave()
    pending = next_of(cs[0], Pending)
    assert pending.world_version == v and "left" in pending.reason
    events = []
    while True:
        ev = cs[0].next_event(5.0)
        events.append(ev)
        if isinstance(ev, WorldInfo) or ev is None:
            break
    assert not any(isinstance(e, Abort) for e in events)
    assert events[-1].world_version == v + 1 and events[-1].size == 2


def test_hot_spare_replaces_failed_member(serve, client):
    s = serve()
    job = unique("job")
    spec = JobSpec(min_np=2, max_np=2)
    cs = [client(s.address, f"w{i}", job_id=job, spec=spec) for i in range(2)]
    for c in cs:
        c.join()
    wait_world_of(cs, 2)
    spare = client(s.address, "spare", job_id=job, spec=spec)
    spare.join()
    assert next_of(spare, Standby).reason == ("beyond max_np=2: a hot spare, it takes the place of the next member "
                                              "that fails or leaves")
    cs[0].close()
    worlds = wait_world_of([cs[1], spare], 2, min_version=2)
    assert [m.worker_id for m in worlds[0].peers] == ["w1", "spare"]


def test_simultaneous_joins_become_one_world(serve, client):
    s = serve(settle_s=0.3)
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda c: c.join(), cs))
    worlds = wait_world_of(cs, 6)
    assert worlds[0].world_version == 1


def test_highest_commit_step_becomes_rank_zero_of_next_world(serve, client):
    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(3)]
    v = join_world(cs)
    cs[2].report_progress(commit_step=40)
    cs[1].report_progress(commit_step=30)
    cs[0].close()
    worlds = wait_world_of(cs[1:], 2, min_version=v + 1)
    assert [m.worker_id for m in worlds[0].peers] == ["w2", "w1"]


def test_report_failure_evicts_suspect_without_stream_at_once(serve, client, stub):
    s = serve(heartbeat_timeout_s=30.0)
    job = unique("job")
    a = client(s.address, "a", job_id=job)
    a.join()
    raw = stub(s)  # b: a bare stub that will not reattach once its stream is gone
    sid = raw.Join(pb.JoinRequest(job_id=job, worker_id="b", host="h", ring_address="127.0.0.1:5",
                                  commit_step=-1), timeout=5).session_id
    call = raw.Watch(pb.WatchRequest(session_id=sid), timeout=30)
    next(iter(call))
    world = wait_until(lambda: a.world if a.world and a.world.size == 2 else None, 5.0, "2-world")
    # As right after a leader change, before b reattached: b is registered but has no stream.
    s.call(_detach(s, job, "b"))
    # heartbeat_timeout is 30 s: only the report can explain an eviction within these deadlines.
    assert a.report_failure("b", world.world_version, "connection refused") is True
    assert next_of(a, Abort, timeout_s=2.0).world_version == world.world_version
    assert next_of(a, WorldInfo, timeout_s=2.0).size == 1
    call.cancel()


@pytest.mark.slow
def test_a_probe_answered_by_another_member_does_not_vouch_for_the_suspect(serve, client, stub):
    s = serve(heartbeat_timeout_s=1.0)
    job = unique("job")
    a = client(s.address, "a", job_id=job)
    a.join()
    raw = stub(s)
    sessions = {}
    for w in ("b", "c"):   # b never answers its probes; c would answer them for it
        sessions[w] = raw.Join(pb.JoinRequest(job_id=job, worker_id=w, host="h", ring_address="127.0.0.1:5",
                                              commit_step=-1), timeout=5).session_id
    calls = {w: raw.Watch(pb.WatchRequest(session_id=sid), timeout=30) for w, sid in sessions.items()}
    streams = {w: iter(call) for w, call in calls.items()}
    for it in streams.values():
        next(it)
    world = wait_until(lambda: a.world if a.world and a.world.size == 3 else None, 5.0, "3-world")
    answered = []

    def answer_for_b():
        for ev in streams["b"]:
            if ev.WhichOneof("event") == "probe":
                raw.AnswerProbe(pb.AnswerProbeRequest(session_id=sessions["c"], nonce=ev.probe.nonce), timeout=5)
                answered.append(ev.probe.nonce)
                return

    import threading
    t = threading.Thread(target=answer_for_b, daemon=True)
    t.start()
    resp = raw.ReportFailure(pb.ReportFailureRequest(session_id=sessions["c"], world_version=world.world_version,
                                                     suspect_worker_id="b", reason="timeout"), timeout=10)
    t.join(5)
    assert answered, "b was never probed"
    # c's answer did not count: b's connection stayed alive, so the world is re-formed, not trusted.
    assert not resp.evicted and "did not answer the probe" in resp.detail, resp.detail
    for call in calls.values():
        call.cancel()


async def _detach(s, job, worker):
    """Forget a worker's stream without evicting it (what a new leader starts with)."""
    from rendezvous.server.job_record import END
    stream = s.service.jobs[job].streams.pop(worker)
    stream.closed_by_server = True
    stream.queue.put_nowait(END)


def test_report_failure_of_live_peer_is_refuted_by_probe(serve, client):
    s = serve()
    job = unique("job")
    a, b = (client(s.address, w, job_id=job) for w in "ab")
    a.join()
    b.join()
    w = wait_world_of([a, b], 2)[0]
    assert a.report_failure("b", w.world_version, "timeout") is False
    assert a.report_failure("b", w.world_version - 1, "old") is False     # stale version ignored
    # b stays: the reporter's ring is broken all the same, so the world re-forms with both (as soon
    # as both acknowledged the abort), once.
    nxt = a.wait_world(timeout_s=5.0, min_version=w.world_version + 1)
    assert nxt.world_version == w.world_version + 1 and sorted(m.worker_id for m in nxt.peers) == ["a", "b"]
    assert set(s.service.jobs[job].state.workers) == {"a", "b"}


def test_a_small_worlds_survivors_acknowledge_an_abort_and_the_next_world_forms_without_the_window(
        serve, client):
    import dataclasses
    s = serve()
    job = unique("job")
    a, b, c = (client(s.address, w, job_id=job) for w in "abc")
    for x in (a, b, c):
        x.join()
    w = wait_world_of([a, b, c], 3)[0]
    # From here on only the survivors' acknowledgements can form the next world within a minute.
    slow = dataclasses.replace(s.service.journal.config, settle_s=60.0, settle_max_s=60.0)
    s.service.journal.config = s.service.timers.decision = slow
    c.close()   # its stream breaks: evicted, the world of 3 aborted
    assert next_of(a, Abort).world_version == w.world_version
    nxt = wait_world_of([a, b], 2, timeout_s=20.0, min_version=w.world_version + 1)[0]
    assert nxt.world_version == w.world_version + 1


def test_repeatedly_failing_host_is_blacklisted(serve, client, stub):
    s = serve(blacklist_after=1, cooldown_min_s=30.0)
    job = unique("job")
    good = client(s.address, "good", job_id=job, host="good")
    bad = client(s.address, "bad", job_id=job, host="bad")
    good.join()
    bad.join()
    wait_world_of([good, bad], 2)
    bad.close()
    next_of(good, Abort)
    again = client(s.address, "bad2", job_id=job, host="bad")
    with pytest.raises(RendezvousRPCError) as e:
        again.join()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "blacklisted" in str(e.value)
    status = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5)
    assert list(status.jobs[0].blacklisted_hosts) == ["bad"]


@pytest.mark.slow
def test_below_min_np_fails_job_after_elastic_timeout(serve, client):
    s = serve()
    job = unique("job")
    spec = JobSpec(min_np=2, max_np=2, elastic_timeout_s=0.5)
    a, b = (client(s.address, w, job_id=job, spec=spec) for w in "ab")
    a.join()
    b.join()
    wait_world_of([a, b], 2)
    b.close()
    fin = next_of(a, Finished, timeout_s=5.0)
    assert not fin.succeeded and "below min_np=2" in fin.reason


def test_the_job_succeeds_once_every_member_of_its_world_returned_at_the_same_commit(serve, client):
    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(3)]
    for c in cs:
        c.join()
    wait_world_of(cs, 3)
    assert cs[1].report_success(commit_step=9) is False   # one member's success ends nothing
    assert cs[0].report_success(commit_step=9) is False
    assert cs[2].next_event(0.3) is None
    assert cs[2].report_success(commit_step=9) is True
    for c in cs:
        fin = next_of(c, Finished)
        assert fin.succeeded and "returned at commit step 9 (w0, w1, w2)" in fin.reason
    late = client(s.address, "late", job_id=job)
    with pytest.raises(RendezvousRPCError) as e:
        late.join()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.finished is True


def test_evicted_worker_learns_its_session_ended(serve, client):
    s = serve()
    job = unique("job")
    a, b = (client(s.address, w, job_id=job) for w in "ab")
    a.join()
    b.join()
    wait_world_of([a, b], 2)
    assert a.report_failure("b", 1) is False  # b is alive; now make the server evict it anyway:
    s.call(_evict(s, job, "b"))
    ended = next_of(b, Ended)
    assert ended.reason.startswith("NOT_FOUND") and "evicted" in ended.reason


async def _evict(s, job, worker):
    svc = s.service
    svc.evict(svc.jobs[job], worker, "test eviction")


def test_status_lists_jobs_members_and_ranks(serve, client, stub):
    from rendezvous.cli import format_status
    from rendezvous.client.status_client import StatusClient

    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job, host="node") for i in range(2)]
    v = join_world(cs)
    resp = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5)
    (j,) = resp.jobs
    assert j.phase == "RUNNING" and j.world_version == v
    assert [(m.member.worker_id, m.member.rank, m.attached) for m in j.members] == [
        ("w0", 0, True), ("w1", 1, True)]
    with StatusClient([s.address]) as status:
        answer = status.status(job)
    assert [(m.worker_id, m.rank, m.attached) for m in answer.jobs[0].members] == [
        ("w0", 0, True), ("w1", 1, True)]
    table = format_status(answer)
    assert f"job {job}  phase RUNNING  world {v}" in table and "w1" in table


def test_status_lists_a_jobs_members_in_pages_and_the_client_reads_them_all(serve, client, stub):
    from rendezvous.client.status_client import StatusClient

    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job, host=f"node{i // 2}") for i in range(7)]
    v = join_world(cs)
    (j,) = stub(s).Status(pb.StatusRequest(job_id=job, members_from=3, max_members=3), timeout=5).jobs
    assert (j.members_from, j.members_total, j.world_version) == (3, 7, v)
    assert [m.member.rank for m in j.members] == [3, 4, 5]
    (last,) = stub(s).Status(pb.StatusRequest(job_id=job, members_from=6, max_members=3), timeout=5).jobs
    assert [m.member.rank for m in last.members] == [6]
    (whole,) = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5).jobs   # under one page
    with StatusClient([s.address], page=3) as status:
        answer = status.status(job)
    assert [m.rank for m in answer.jobs[0].members] == list(range(7))
    assert [m.worker_id for m in answer.jobs[0].members] == [m.member.worker_id for m in whole.members]


@pytest.mark.slow
def test_64_concurrent_clients_agree_on_one_world(serve, client):
    s = serve(settle_s=0.2)
    job = unique("job")
    cs = [client(s.address, f"w{i:02d}", job_id=job, host=f"h{i // 8}",
                      spec=JobSpec(min_np=64, max_np=64)) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda c: c.join(), cs))
    worlds = wait_world_of(cs, 64, timeout_s=20.0)
    assert worlds[0].world_version == 1
    assert all(w.local_size == 8 and w.cross_size == 8 for w in worlds)


@pytest.mark.slow
def test_finished_job_is_forgotten_after_retention_and_its_id_reusable(serve, client, stub):
    s = serve(finished_job_retention_s=0.3)
    job = unique("job")
    a = client(s.address, "a", job_id=job)
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
    again = client(s.address, "b", job_id=job)
    again.join()
    assert wait_world_of([again], 1)[0].world_version == 1   # a fresh job under the same id


@pytest.mark.slow
def test_worker_that_joins_but_never_watches_stays_out_of_worlds_and_is_evicted(serve, client, stub):
    s = serve(heartbeat_timeout_s=1.0)
    job = unique("job")
    a = client(s.address, "a", job_id=job)
    a.join()
    stub(s).Join(pb.JoinRequest(job_id=job, worker_id="ghost", host="ghost-host",
                                ring_address="127.0.0.1:5", commit_step=-1), timeout=5)
    world = a.wait_world(timeout_s=5.0)
    assert [m.worker_id for m in world.peers] == ["a"]
    joined = time.monotonic()

    def ghost_gone():
        members = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0].members
        return [m.member.worker_id for m in members] == ["a"]
    wait_until(ghost_gone, 3.0, "the ghost to be evicted")
    assert time.monotonic() - joined < 1.0 + 1.0
    status = stub(s).Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0]
    assert status.world_version == world.world_version    # it never was in a world: nothing to re-form
    assert list(status.blacklisted_hosts) == []


def test_watch_snapshot_shows_the_stored_world_not_a_pending_in_memory_one(serve, client, stub):
    """While a write is slow (or will fail), a reattaching worker must see what is stored."""
    import asyncio
    import json

    s = serve(settle_s=0.05)
    job = unique("job")
    cs = [client(s.address, w, job_id=job) for w in "abc"]
    v = join_world(cs)
    store = s.server.store
    gate = asyncio.Event()
    real_commit = store.commit

    async def held_put(puts, deletes=(), **kw):   # job writes wait for the gate (a stalled etcd)
        if any("/jobs/" in key for key in puts):
            await gate.wait()
        return await real_commit(puts, deletes, **kw)
    store.commit = held_put
    try:
        cs[1].close()   # crash: Abort(v) and then world v + 1 are decided, but cannot be stored
        wait_until(lambda: s.service.jobs[job].state.world_version == v + 1, 5.0,
                   f"world {v + 1} decided in memory")
        call = stub(s).Watch(pb.WatchRequest(session_id=cs[0].session_id), timeout=5)
        first = next(iter(call))
        stored = json.loads(s.call(store.get(f"{s.config.etcd_prefix}/jobs/{job}/head")).value)
        assert stored["world_version"] == v
        assert first.world.world_version == v and [m.worker_id for m in first.world.peers] == \
            ["a", "b", "c"]
        call.cancel()
    finally:
        s.loop.call_soon_threadsafe(gate.set)
        store.commit = real_commit


def test_progress_reports_are_soft_state_and_cost_no_store_writes(serve, client):
    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(4)]
    v = join_world(cs)
    store = s.server.store
    writes = []
    real_commit = store.commit

    async def counting_put(puts, deletes=(), **kw):
        if any("/jobs/" in key for key in puts):
            writes.append(sum(map(len, puts.values())))
        return await real_commit(puts, deletes, **kw)
    store.commit = counting_put
    try:
        for step in range(1, 11):
            for c in cs:
                c.report_progress(commit_step=step * 100 + int(c.worker_id[1:]))
        assert writes == []
        cs[0].close()   # the next real change stores the steps too, and ranks follow them
        worlds = wait_world_of(cs[1:], 3, min_version=v + 1)
        assert [m.worker_id for m in worlds[0].peers] == ["w3", "w1", "w2"]
        assert len(writes) >= 1
    finally:
        store.commit = real_commit


def test_commit_step_is_resent_when_reattaching(serve, client):
    s = serve(heartbeat_timeout_s=30.0)
    job = unique("job")
    cs = [client(s.address, w, job_id=job) for w in ("a", "b", "c")]
    v = join_world(cs)
    cs[2].report_progress(commit_step=70)
    s.call(_forget_steps(s, job))            # as a new leader would see them: stored steps only
    s.call(_detach(s, job, "c"))             # c reattaches at once, resending step 70
    wait_until(lambda: "c" in s.service.jobs[job].streams, 5.0, "c to reattach")
    cs[0].close()
    worlds = wait_world_of(cs[1:], 2, min_version=v + 1)
    assert [m.worker_id for m in worlds[0].peers] == ["c", "b"]


async def _forget_steps(s, job):
    from dataclasses import replace
    j = s.service.jobs[job]
    j.state = replace(j.state, workers={k: replace(w, commit_step=-1)
                                        for k, w in j.state.workers.items()})


def test_write_that_landed_but_reported_an_error_keeps_leadership(serve, client):
    """An ambiguous etcd write (applied, response lost): the retry's CAS is refused because our own
    write moved the revision; re-reading shows our bytes, so the replica carries on leading."""
    from rendezvous.server.store import StoreError

    s = serve()
    job = unique("job")
    cs = [client(s.address, f"w{i}", job_id=job) for i in range(3)]
    v = join_world(cs)
    store = s.server.store
    real_commit = store.commit
    armed = [True]

    async def lossy_put(puts, deletes=(), **kw):
        rev = await real_commit(puts, deletes, **kw)
        if armed[0] and any("/jobs/" in key for key in puts):
            armed[0] = False
            raise StoreError("put timed out (simulated: applied, response lost)")
        return rev
    store.commit = lossy_put
    try:
        cs[2].leave()                   # a real change: Pending, then world v + 1
        worlds = wait_world_of(cs[:2], 2, min_version=v + 1)
        assert worlds[0].world_version == v + 1 and not armed[0]
        assert s.service.is_leader and s.service.leadership_losses == 0
    finally:
        store.commit = real_commit


def test_membership_events_are_logged_when_they_take_effect_not_when_decided(serve, client, caplog):
    import asyncio
    import logging

    caplog.set_level(logging.INFO, logger="rendezvous.server.service")
    s = serve(settle_s=0.05)
    job = unique("job")
    cs = [client(s.address, w, job_id=job) for w in "ab"]
    v = join_world(cs)
    store = s.server.store
    gate = asyncio.Event()
    real_commit = store.commit

    async def held_put(puts, deletes=(), **kw):
        if any("/jobs/" in key for key in puts):
            await gate.wait()
        return await real_commit(puts, deletes, **kw)
    store.commit = held_put
    try:
        cs[1].close()
        wait_until(lambda: s.service.jobs[job].state.world_version == v + 1, 5.0, f"world {v + 1} decided")
        assert f"job {job}: world {v + 1} announced" not in caplog.text
    finally:
        s.loop.call_soon_threadsafe(gate.set)
        store.commit = real_commit
    wait_until(lambda: f"job {job}: world {v + 1} announced" in caplog.text, 5.0,
               "the announcement log")
    assert f"job {job}: abort world {v}" in caplog.text


def test_store_error_while_creating_a_job_is_unavailable(serve, stub):
    from rendezvous.server.store import StoreError

    s = serve()
    store = s.server.store
    real_commit = store.commit

    async def failing_put(puts, deletes=(), **kw):
        if any("/jobs/" in key for key in puts):
            raise StoreError("etcd put failed (simulated)")
        return await real_commit(puts, deletes, **kw)
    store.commit = failing_put
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub(s).Join(pb.JoinRequest(job_id=unique("job"), worker_id="w", host="h",
                                        ring_address="127.0.0.1:5", commit_step=-1,
                                        spec=pb.JobSpec(min_np=1, max_np=2)), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "cannot create" in e.value.details()
    finally:
        store.commit = real_commit


@pytest.mark.slow
def test_leadership_lapsing_while_jobs_load_makes_the_replica_campaign_again(client):
    """etcd stalls right after the campaign: the lease lapses while the jobs load. The replica
    must notice and lead again once etcd answers, not believe it leads and serve nothing."""
    from rendezvous.server.store import MemoryStore, StoreError

    class StallAfterCampaign(MemoryStore):
        loads = 0
        stalled = False

        async def get_prefix(self, prefix):
            StallAfterCampaign.loads += 1
            if StallAfterCampaign.loads == 1:  # the first load: refreshes fail until it returns
                StallAfterCampaign.stalled = True
                await asyncio.sleep(1.5)        # longer than the step-down time (0.6 x TTL 1 s)
                StallAfterCampaign.stalled = False
            return await super().get_prefix(prefix)

        async def claim(self, key, value, ttl_s):
            claim = await super().claim(key, value, ttl_s)
            if claim is not None:   # its refreshes fail while the first load stalls
                refresh = claim.refresh

                async def stalled_refresh():
                    if StallAfterCampaign.stalled:
                        raise StoreError("etcd stalled (test)")
                    return await refresh()
                claim.refresh = stalled_refresh
            return claim

    s = ServerThread(server_config(leader_ttl_s=1), StallAfterCampaign)  # waits until it leads
    try:
        assert StallAfterCampaign.loads >= 2, "the replica must have loaded the jobs again"
        assert s.service.is_leader
        c = client([s.address], "w0", job_id=unique("job"))
        c.join(timeout_s=10)  # served
        c.close()
    finally:
        s.stop()
