"""The worker-side client: failover across addresses, deadlines, TLS."""
from __future__ import annotations

import subprocess
import threading
import time

import grpc
import pytest

from rendezvous.cli import main
from rendezvous.common.channel import RendezvousCallAbandoned, RendezvousRPCError
from rendezvous.wire.membership import JobSpec
from rendezvous.client.watch_events import Ended
from rendezvous.server.etcd_process import free_port
from rendezvous.server.store import MemoryStore

from .rdzv_helpers import ServerThread, make_client, server_config, unique, wait_until, wait_world_of


@pytest.fixture(scope="module")
def server():
    s = ServerThread(server_config(), MemoryStore)
    yield s
    s.stop()


def test_dead_address_is_skipped_for_the_next_one(server, client):
    dead = f"127.0.0.1:{free_port()}"
    job = unique("job")
    c = client([dead, server.address], "w0", job_id=job)
    c.join(timeout_s=10)
    assert wait_world_of([c], 1)[0].world_version == 1
    assert c.report_progress(commit_step=3) == 1


def test_a_world_carrying_the_abort_of_the_one_before_is_told_as_that_abort_then_the_world(client):
    from rendezvous.client.watch_events import Abort, WorldInfo
    from rendezvous.wire.messages import pb

    c = client("127.0.0.1:1", "a", job_id="j")
    aborted = pb.AbortVersion(world_version=1, reason="worker b on host h evicted: watch stream broken")
    world = pb.WatchEvent(world=pb.World(world_version=2, size=1, peers=[pb.Member(worker_id="a")],
                                         digest=b"d2", aborted=aborted))
    c._handle(pb.WatchEvent(abort=aborted), "127.0.0.1:1", c._gen)   # already told on its own: once
    c._handle(world, "127.0.0.1:1", c._gen)
    got = [c.next_event(0), c.next_event(0), c.next_event(0)]
    assert isinstance(got[0], Abort) and (got[0].world_version, got[0].reason) == (1, aborted.reason)
    assert isinstance(got[1], WorldInfo) and got[1].world_version == 2 and got[2] is None
    c2 = client("127.0.0.1:1", "a2", job_id="j")
    c2._handle(world, "127.0.0.1:1", c2._gen)   # only with the world: the abort first
    got = [c2.next_event(0), c2.next_event(0)]
    assert [type(e) for e in got] == [Abort, WorldInfo] and got[0].world_version == 1


@pytest.mark.slow
def test_no_reachable_server_fails_within_the_deadline_naming_addresses(client):
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    c = client(dead, "w0", job_id=unique("job"))
    start = time.monotonic()
    with pytest.raises(RendezvousRPCError) as e:
        c.join(timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and dead[0] in str(e.value)


@pytest.mark.slow
def test_a_join_no_server_answers_is_given_up_once_asked_after_the_attempt_under_way(client):
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    c = client(dead, "w0", job_id=unique("job"))
    give_up = threading.Event()
    start = time.monotonic()   # before the timer starts: it is set 0.5 s or more after this
    threading.Timer(0.5, give_up.set).start()
    with pytest.raises(RendezvousCallAbandoned) as e:
        c.join(timeout_s=30.0, give_up=give_up)
    took = time.monotonic() - start
    assert 0.5 <= took < 0.5 + 3.0, took   # not at the 30 s deadline: within a backoff of the ask
    assert e.value.code == grpc.StatusCode.CANCELLED and "given up after" in str(e.value)
    assert dead[0] in str(e.value) and c.session_id is None


def test_a_join_asked_to_give_up_before_it_starts_still_makes_its_first_attempt(server, client):
    # The attempt under way is never cut short: when it is answered, the join stands (the caller
    # leaves through the server then, with a session it knows).
    give_up = threading.Event()
    give_up.set()
    c = client(server.address, "w0", job_id=unique("job"))
    assert c.join(give_up=give_up) == c.session_id and len(c.ring_secret) == 32
    assert wait_world_of([c], 1)[0].size == 1


def test_wait_world_times_out_with_job_and_worker_named(server, client):
    job = unique("job")
    c = client(server.address, "lonely", job_id=job, spec=JobSpec(min_np=2, max_np=2))
    c.join()
    with pytest.raises(TimeoutError, match=f"job {job} worker lonely"):
        c.wait_world(timeout_s=0.3)


def test_calls_before_join_are_refused_clearly(server, client):
    c = client(server.address, "early", job_id=unique("job"))
    with pytest.raises(RendezvousRPCError, match="join\\(\\) first"):
        c.report_progress(1)


@pytest.mark.slow
def test_tls_server_accepts_tls_clients_and_refuses_plaintext(client, tmp_path, capsys):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    s = ServerThread(server_config(tls_cert=str(cert), tls_key=str(key)), MemoryStore)
    try:
        job = unique("job")
        address = f"localhost:{s.port}"
        c = client(address, "w0", job_id=job, tls_root_cert=cert.read_bytes())
        c.join(timeout_s=10)
        assert wait_world_of([c], 1)[0].size == 1
        plain = client(address, "w1", job_id=job)
        with pytest.raises(RendezvousRPCError) as e:
            plain.join(timeout_s=1.0)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert main(["status", "--server", address, "--tls-ca", str(cert), "--job", job]) == 0
        assert f"job {job}  phase RUNNING  world 1" in capsys.readouterr().out
        c.close()
        plain.close()
    finally:
        s.stop()


def _events(client, until, timeout_s=5.0):
    """Events up to and including the first one matching `until` (fails after the deadline)."""
    out = []
    deadline = time.monotonic() + timeout_s
    while not (out and until(out[-1])):
        ev = client.next_event(deadline - time.monotonic())
        assert ev is not None, f"{client.worker_id}: nothing matching within {timeout_s} s; {out}"
        out.append(ev)
    return out


def _attached(server, job):
    import grpc as _grpc
    from rendezvous.wire.messages import pb, pb_grpc
    with _grpc.insecure_channel(server.address) as ch:
        st = pb_grpc.RendezvousStub(ch).Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0]
    return [(m.member.worker_id, m.attached) for m in st.members]


@pytest.mark.parametrize("trial", range(3))
def test_rejoin_delivers_nothing_from_the_replaced_session(server, client, trial):
    from rendezvous.client.watch_events import Ended, WorldInfo

    job = unique("job")
    c = client(server.address, "a", job_id=job)
    c.join()
    assert c.wait_world(timeout_s=5.0).world_version == 1
    c.join()   # e.g. the runtime decided to come back as a new member
    events = _events(c, lambda e: isinstance(e, WorldInfo) and e.world_version >= 2)
    assert not [e for e in events if isinstance(e, Ended)], events
    assert c._watching and c._watch_thread.is_alive()
    assert _attached(server, job) == [("a", True)]


def test_world_with_same_version_but_other_members_is_a_new_event(client):
    from rendezvous.wire.messages import pb

    c = client("127.0.0.1:1", "a", job_id="j")

    def world(*members):
        # A world is named by its digest: the server's over every member (world_views.world_digest).
        return pb.WatchEvent(world=pb.World(world_version=1, size=len(members), peers=[
            pb.Member(worker_id=w, rank=i) for i, w in enumerate(members)], digest="".join(members).encode()))
    for ev in (world("a", "b"), world("a", "b"), world("a", "c")):
        c._handle(ev, "127.0.0.1:1", c._gen)
    got = [c.next_event(0), c.next_event(0), c.next_event(0)]
    assert [[m.worker_id for m in w.peers] for w in got[:2]] == [["a", "b"], ["a", "c"]]
    assert got[2] is None


@pytest.mark.slow
def test_leave_whose_first_attempt_timed_out_but_took_effect_succeeds_and_closes(client):
    import asyncio

    s = ServerThread(server_config(), MemoryStore)
    try:
        job = unique("job")
        a = client(s.address, "a", job_id=job)
        b = client(s.address, "b", job_id=job, rpc_timeout_s=0.5)
        a.join()
        b.join()
        wait_world_of([a, b], 2)
        store = s.server.store
        real_commit = store.commit

        async def slow_put(puts, deletes=(), **kw):   # the Leave is applied, its answer comes too late
            await asyncio.sleep(0.8)
            return await real_commit(puts, deletes, **kw)
        store.commit = slow_put
        b.leave()
        assert not b._watch_thread.is_alive()
        store.commit = real_commit
        assert [w for w, _ in _attached(s, job)] == ["a"]
        a.close()
    finally:
        s.stop()


def test_internal_errors_are_not_retried_and_leave_still_closes(client):
    s = ServerThread(server_config(), MemoryStore)
    try:
        c = client(s.address, "a", job_id=unique("job"))
        c.join()
        c.wait_world(timeout_s=5.0)   # its Watch is open: only our calls reach _by_session now
        calls = []

        def broken(sid):    # a server bug: the RPC answers INTERNAL
            calls.append(sid)
            raise RuntimeError("bug")
        s.service._by_session = broken
        with pytest.raises(RendezvousRPCError) as e:
            c.report_progress(commit_step=1, timeout_s=3.0)
        assert e.value.code == grpc.StatusCode.INTERNAL and len(calls) == 1
        with pytest.raises(RendezvousRPCError):
            c.leave()
        assert c._closed.is_set() and not c._watch_thread.is_alive()
    finally:
        s.stop()


def _finished_job(s, succeeded):
    """A job whose only member ended it: by reporting success, or by leaving below min_np=1 for
    an elastic timeout of 0.2 s."""
    job = unique("job")
    a = make_client(s.address, "a", job_id=job, spec=JobSpec(min_np=1, max_np=2,
                                                             elastic_timeout_s=0.2))
    a.join()
    a.wait_world(timeout_s=5.0)
    if succeeded:
        a.report_success()
    else:
        a.leave()
        wait_until(lambda: s.service.jobs[job].state.phase.value == "FAILED", 5.0, "the job to fail")
    a.close()
    return job


@pytest.mark.parametrize("succeeded", [True, False], ids=["succeeded", "failed"])
def test_a_join_after_the_job_ended_is_refused_with_the_outcome_typed(server, client, succeeded):
    job = _finished_job(server, succeeded)
    late = client(server.address, "late", job_id=job)
    with pytest.raises(RendezvousRPCError) as e:
        late.join()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.finished is succeeded


def test_refusals_for_other_reasons_carry_no_outcome(server, client):
    job = unique("job")
    a = client(server.address, "a", job_id=job, spec=JobSpec(min_np=1, max_np=2))
    a.join()
    other = client(server.address, "b", job_id=job, spec=JobSpec(min_np=1, max_np=3))
    with pytest.raises(RendezvousRPCError) as e:   # spec mismatch: FAILED_PRECONDITION as well
        other.join()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.finished is None


def test_a_session_that_ended_with_the_job_ends_with_the_outcome_typed(server, client):
    """The worker was evicted while its stream was away (stopped, say) and the job ended meanwhile:
    reattaching, it learns how the job ended from the refusal, typed."""
    from rendezvous.server import decision as d
    from rendezvous.server.job_record import END

    job = unique("job")
    a, b = (client(server.address, w, job_id=job) for w in "ab")
    a.join()
    b.join()
    world = wait_world_of([a, b], 2)[0]

    async def away_evicted_and_over():   # at once, on the server's loop: no RPC comes in between
        svc = server.service
        j = svc.jobs[job]
        stream = j.streams.pop("b")
        stream.closed_by_server = True
        stream.queue.put_nowait(END)
        svc.evict(j, "b", "stopped")
        svc.journal.apply(j, d.Success("a", world.world_version))
    server.call(away_evicted_and_over())
    deadline = time.monotonic() + 10.0
    ev = None
    while not isinstance(ev, Ended):
        ev = b.next_event(deadline - time.monotonic())
        assert ev is not None, "b's session did not end"
    assert ev.finished is True and ev.reason.startswith("FAILED_PRECONDITION")


@pytest.mark.slow
def test_join_whose_first_attempt_timed_out_but_landed_retries_until_its_ghost_is_evicted(client):
    """The first attempt registered a session this client never learnt; the worker id is taken
    without proof (ALREADY_EXISTS) until that session, never watched, is evicted."""
    import asyncio

    s = ServerThread(server_config(heartbeat_timeout_s=1.0), MemoryStore)
    try:
        job = unique("job")
        a = client(s.address, "a", job_id=job)
        a.join()
        wait_world_of([a], 1)
        store = s.server.store
        real_commit = store.commit
        armed = [True]

        async def slow_once(puts, deletes=(), **kw):   # b's first Join lands, its answer comes too late
            if armed[0] and any("/jobs/" in key for key in puts):
                armed[0] = False
                await asyncio.sleep(0.8)
            return await real_commit(puts, deletes, **kw)
        store.commit = slow_once
        b = client(s.address, "b", job_id=job, rpc_timeout_s=0.5)
        try:
            b.join(timeout_s=15)
        finally:
            store.commit = real_commit
        assert not armed[0] and len(b.ring_secret) == 32
        worlds = wait_world_of([a, b], 2, min_version=2)
        assert sorted(m.worker_id for m in worlds[0].peers) == ["a", "b"]
        a.close()
        b.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_rejoin_sends_the_previous_session_and_keeps_the_ring_secret(server, client):
    job = unique("job")
    c = client(server.address, "a", job_id=job)
    first = c.join()
    secret = c.ring_secret
    second = c.join()
    assert second != first and c.ring_secret == secret


def test_status_reads_a_jobs_pages_again_when_its_world_changes_between_them():
    from rendezvous.client.status_client import StatusClient
    from rendezvous.wire.messages import pb

    def job(version: int, first: int, ranks: range) -> pb.StatusResponse:
        j = pb.JobStatus(job_id="j", world_version=version, members_from=first, members_total=4)
        for r in ranks:
            j.members.add(member=pb.Member(worker_id=f"w{r}", rank=r), in_world=True)
        return pb.StatusResponse(jobs=[j])
    answers = iter([job(1, 0, range(0, 2)), job(2, 2, range(2, 4)),    # world 2 arrived between pages
                    job(2, 0, range(0, 2)), job(2, 2, range(2, 4))])

    def call(**request) -> pb.StatusResponse:
        return next(answers)
    first = call()
    assert StatusClient._rest_of(call, first.jobs[0]) is None
    again = call()
    assert [m.member.rank for m in StatusClient._rest_of(call, again.jobs[0])] == [0, 1, 2, 3]
