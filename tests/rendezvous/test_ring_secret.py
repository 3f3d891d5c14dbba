"""A job's ring secret and sessions end to end: random per job, only in the members' rings, kept in
etcd across a server restart; and right after a restart a failure report is evidence, not a verdict."""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time

import grpc
import numpy as np
import pytest

import elastic
from elastic.runtime.job_session import Ending
from rendezvous.wire.messages import pb, pb_grpc
from rendezvous.common.channel import RendezvousRPCError
from rendezvous.server.store import EtcdStore, MemoryStore

from .rdzv_helpers import ServerThread, make_client, server_config, unique, wait_until, wait_world_of

TOKEN, OTHER = "tenant-a-token", "tenant-b-token"


def _runtime(address: str, job: str, worker: str):
    """A worker's real session (ring listener, rendezvous client, pump), configured from the
    environment the launcher would set."""
    from elastic.runtime.worker_config import WorkerConfig
    from elastic.runtime.job_session import JobSession as Session

    rt = Session(WorkerConfig.from_env({
        "ELASTIC_RENDEZVOUS": address, "ELASTIC_JOB_ID": job, "ELASTIC_WORKER_ID": worker,
        "ELASTIC_HOST": "h", "ELASTIC_MIN_NP": "2", "ELASTIC_MAX_NP": "2",
        "ELASTIC_WORLD_TIMEOUT": "30", "ELASTIC_COLLECTIVE_TIMEOUT": "20"}))
    rt.start()
    return rt


def _in_threads(fns, timeout_s=30.0):
    out, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a ring operation did not finish"
    return out


def test_a_stranger_with_the_old_derived_secret_is_refused_by_a_real_workers_ring():
    # As `elastic-run` on one machine ran it: an insecure embedded server, the default job id.
    s = ServerThread(server_config(), MemoryStore)
    job = "default"
    rts = [_runtime(s.address, job, w) for w in ("w0", "w1")]
    try:
        comms = _in_threads([lambda rt=rt: rt.form(rt.next_world(1)) for rt in rts])
        world = rts[0].world
        target = next(m.ring_address for m in world.peers if m.rank == 0)
        # What anyone who knew the job id could compute before: HMAC(token or "", job id).
        derived = hmac.new(b"", f"elastic-ring ring secret:{job}".encode(),
                           hashlib.sha256).hexdigest().encode()
        for secret in (derived, bytes.fromhex(derived.decode())):
            listener = elastic.Listener("127.0.0.1", 0)
            try:   # posing as rank 1, rank 0's predecessor, in the live world
                # The real rank 0 refuses it, and the refusal (signed with the job's secret) is
                # not one the stranger can verify: to it, rank 0 is a bad peer.
                with pytest.raises(elastic.BadPeerError) as info:
                    elastic.Communicator.form(listener=listener, job_id=job, secret=secret,
                                              world_version=world.world_version, rank=1,
                                              peers=[target, listener.address],
                                              config=elastic.CommConfig(form_timeout=5))
            finally:
                listener.close()
            assert info.value.kind == elastic.ErrorKind.BadPeer, info.value
        bufs = [np.full(1000, r + 1.0) for r in range(2)]
        _in_threads([lambda c=c, b=b: c.allreduce_(b, elastic.Sum) for c, b in zip(comms, bufs)])
        assert all(b[0] == 3.0 for b in bufs)   # the ring never noticed
    finally:
        for rt in rts:
            rt.finish(Ending.CLOSED)
        s.stop()


# ------------------------------------------------------------------------- across a restart
def _etcd_server(etcd, prefix: str, port: int = 0, **kw) -> ServerThread:
    return ServerThread(server_config(port=port, etcd_prefix=prefix, **kw),
                        lambda: EtcdStore([etcd.endpoint]))


def _restart(server: ServerThread, etcd, prefix: str, **kw) -> ServerThread:
    """Stop `server` (gracefully: no one is evicted) and start another on the same address."""
    port = server.port
    server.stop()
    return _etcd_server(etcd, prefix, port=port, **kw)


@pytest.mark.slow
def test_ring_secret_sessions_and_ownership_survive_a_server_restart_over_etcd(etcd):
    prefix = f"/t/{unique('secret-restart')}"
    kw = dict(insecure=False, tokens=(TOKEN, OTHER))
    s = _etcd_server(etcd, prefix, **kw)
    job = unique("job")
    a = make_client(s.address, "a", job_id=job, token=TOKEN)
    try:
        a.join()
        world = wait_world_of([a], 1)[0]
        secret = a.ring_secret
        s = _restart(s, etcd, prefix, **kw)
        b = make_client(s.address, "b", job_id=job, token=TOKEN)
        b.join()
        assert b.ring_secret == secret and len(secret) == 32
        # a's session is still a's (stored with its worker record): its client reattached with it.
        assert wait_until(lambda: a.report_progress(commit_step=1, timeout_s=2.0) >= world.world_version,
                          10.0, "a's session to work on the new server")
        stranger = make_client(s.address, "x", job_id=job, token=OTHER)
        with pytest.raises(RendezvousRPCError) as e:
            stranger.join(timeout_s=5)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and stranger.ring_secret is None
        b.close()
        stranger.close()
    finally:
        a.close()
        s.stop()


def _raw_member(stub, job, worker):
    sid = stub.Join(pb.JoinRequest(job_id=job, worker_id=worker, host=f"host-{worker}",
                                   ring_address="127.0.0.1:5", commit_step=-1,
                                   spec=pb.JobSpec(min_np=2, max_np=2)), timeout=5).session_id
    call = stub.Watch(pb.WatchRequest(session_id=sid), timeout=60)
    next(iter(call))   # the snapshot: the Watch is open
    return sid, call


def _formed_then_restarted(etcd, caplog):
    """Job of two bare members a and b formed on one server, then the server restarted; neither
    has reattached. Returns (new server, its stub, job, a's session, b's session)."""
    caplog.set_level(logging.INFO, logger="rendezvous.server.service")
    prefix = f"/t/{unique('report-restart')}"
    kw = dict(heartbeat_timeout_s=2.0, blacklist_after=1, settle_s=0.05)
    s = _etcd_server(etcd, prefix, **kw)
    job = unique("job")
    with grpc.insecure_channel(s.address) as ch:
        stub = pb_grpc.RendezvousStub(ch)
        (sid_a, call_a), (sid_b, call_b) = _raw_member(stub, job, "a"), _raw_member(stub, job, "b")
        wait_until(lambda: stub.Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0].world_version
                   == 1, 5.0, "world 1")
        s = _restart(s, etcd, prefix, **kw)   # ends the streams from the server's side
        call_a.cancel()
        call_b.cancel()
    ch = grpc.insecure_channel(s.address)
    return s, ch, pb_grpc.RendezvousStub(ch), job, sid_a, sid_b


def test_right_after_a_restart_a_report_does_not_evict_a_live_worker(etcd, caplog):
    s, ch, stub, job, sid_a, sid_b = _formed_then_restarted(etcd, caplog)
    try:
        answer = {}

        def report():
            answer["resp"] = stub.ReportFailure(pb.ReportFailureRequest(
                session_id=sid_a, world_version=1, suspect_worker_id="b",
                reason="connection refused"), timeout=30)
        reporter = threading.Thread(target=report, daemon=True)
        reporter.start()
        wait_until(lambda: "waiting up to" in caplog.text and " b " in caplog.text, 5.0,
                   "the report to wait for b to reattach")
        call_b = stub.Watch(pb.WatchRequest(session_id=sid_b), timeout=30)   # b is back
        for ev in call_b:   # and answers the probe the report sends it
            if ev.WhichOneof("event") == "probe":
                stub.AnswerProbe(pb.AnswerProbeRequest(session_id=sid_b, nonce=ev.probe.nonce), timeout=5)
                break
        reporter.join(30)
        assert answer["resp"].evicted is False, answer["resp"]
        st = stub.Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0]
        assert sorted(m.member.worker_id for m in st.members) == ["a", "b"]
        assert list(st.blacklisted_hosts) == []
        call_b.cancel()
    finally:
        ch.close()
        s.stop()


@pytest.mark.slow
def test_right_after_a_restart_a_suspect_that_never_returns_is_evicted_after_the_grace_only(etcd, caplog):
    s, ch, stub, job, sid_a, _ = _formed_then_restarted(etcd, caplog)
    try:
        leading = time.monotonic()   # the new server leads from about now (it waited for that)
        resp = stub.ReportFailure(pb.ReportFailureRequest(
            session_id=sid_a, world_version=1, suspect_worker_id="b", reason="connection refused"),
            timeout=30)
        waited = time.monotonic() - leading
        assert resp.evicted is True
        assert waited >= 2.0 - 0.3, f"evicted {waited:.2f} s into the new leadership, before the grace"
        st = stub.Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0]
        assert [m.member.worker_id for m in st.members] == ["a"]
        # It never reattached to this server: the server's doing as much as the host's.
        assert list(st.blacklisted_hosts) == []
    finally:
        ch.close()
        s.stop()
