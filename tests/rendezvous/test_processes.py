"""Integration with real processes and signals: crashed, stopped and GIL-bound workers; server restart
and leader failover against a real etcd; graceful SIGTERM."""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from rendezvous.wire.messages import pb, pb_grpc
from rendezvous.wire.membership import JobSpec
from rendezvous.client.watch_events import Abort, Ended, WorldInfo
from rendezvous.server.server_config import ServerConfig
from rendezvous.server.store import EtcdStore

from .rdzv_helpers import (ServerProc, ServerThread, StallProxy, join_world, make_client, server_config, unique,
                           wait_until)

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane


def status(address, job):
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.RendezvousStub(ch).Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0]


@pytest.fixture
def etcd_server(etcd):
    started = []

    def start(**kw):
        s = ServerThread(server_config(**kw), lambda: EtcdStore([etcd.endpoint]))
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()


# A crashed worker is evicted and the next world announced within 0.3 s at the default settings
# (it forms once the survivors acknowledged the abort, ~0.02 s here, not after the 0.2 s settle
# window). Measured from SIGKILL to the moment a survivor process holds the next world; the stated
# margin of 0.2 s covers a loaded 2-core CI machine (process scheduling, etcd fsync).
CRASH_TO_WORLD_TARGET_S = 0.3
CI_MARGIN_S = 0.2


def test_sigkilled_worker_process_is_evicted_and_survivors_get_next_world_within_0_3_s(
        etcd_server, workers):
    s = etcd_server(settle_s=ServerConfig.settle_s)   # the default settle window
    assert s.config.settle_s == 0.2
    job = unique("job")
    ws = [workers([s.address], job, f"w{i}", min_np=2) for i in range(3)]
    v = max(w.world_of_size(3)["version"] for w in ws)
    killed_at = time.time()
    ws[1].kill(signal.SIGKILL)
    for w in (ws[0], ws[2]):
        abort = w.wait_event(lambda e: e["event"] == "abort" and e["version"] == v, 2.0, "abort")
        assert "w1" in abort["reason"] and "watch stream broken" in abort["reason"]
        world = w.world(v + 1, timeout_s=2.0)
        assert sorted(world["members"]) == ["w0", "w2"]
    latency = max(w.world(v + 1)["t"] for w in (ws[0], ws[2])) - killed_at
    print(f"SIGKILL -> next world on every survivor: {latency:.3f} s")
    assert latency < CRASH_TO_WORLD_TARGET_S + CI_MARGIN_S, latency


def test_after_a_sigkill_the_next_world_waits_for_the_survivors_acknowledgements_not_the_settle_window(
        etcd_server, workers):
    # A settle window far longer than anything else here: a world before it ends can only have
    # formed because every survivor acknowledged the abort.
    s = etcd_server(settle_s=5.0, settle_max_s=10.0)
    job = unique("job")
    ws = [workers([s.address], job, f"w{i}", min_np=2) for i in range(5)]
    v = max(w.world_of_size(5)["version"] for w in ws)
    killed_at = time.time()
    ws[1].kill(signal.SIGKILL)
    worlds = [w.world(v + 1, timeout_s=4.0) for w in (ws[0], ws[2], ws[3], ws[4])]
    # Each holds its view (its ring neighbours); together they name exactly the survivors.
    assert {w["size"] for w in worlds} == {4} and sorted({m for w in worlds for m in w["members"]}) == \
        ["w0", "w2", "w3", "w4"], worlds
    print(f"SIGKILL -> next world on every survivor: {max(w['t'] for w in worlds) - killed_at:.3f} s "
          "(settle window 5 s)")
    # Two killed together are one change: neither acknowledges, so the world waits for both to be
    # evicted and the next one has neither.
    for w in (ws[2], ws[4]):
        w.proc.send_signal(signal.SIGKILL)
    for w in (ws[2], ws[4]):
        w.kill()
    for w in (ws[0], ws[3]):
        assert sorted(w.world(v + 2, timeout_s=4.0)["members"]) == ["w0", "w3"]
        assert not [e for e in w.events if e["event"] == "world" and e["version"] > v + 2]


def test_sigstopped_worker_is_evicted_within_heartbeat_timeout(etcd_server, workers):
    s = etcd_server(heartbeat_timeout_s=2.0)
    job = unique("job")
    ws = [workers([s.address], job, f"w{i}", min_np=2) for i in range(3)]
    v = max(w.world_of_size(3)["version"] for w in ws)
    stopped_at = time.time()
    ws[2].kill(signal.SIGSTOP)
    abort = ws[0].wait_event(lambda e: e["event"] == "abort" and e["version"] == v, 2.0 + 2.0,
                             "abort after SIGSTOP")
    assert "w2" in abort["reason"]
    assert sorted(ws[1].world(v + 1, timeout_s=2.0)["members"]) == ["w0", "w1"]
    print(f"SIGSTOP -> abort notice: {abort['t'] - stopped_at:.3f} s (heartbeat timeout 2 s)")
    # Pings every T/3 with T/3 to answer: cut off by 2T/3; the rest of T is margin for a slow CI.
    assert abort["t"] - stopped_at < 2.0, abort
    ws[2].kill(signal.SIGCONT)  # woken up, it learns it was evicted
    ended = ws[2].wait_event(lambda e: e["event"] == "ended", 5.0, "session ended after SIGCONT")
    assert "NOT_FOUND" in ended["reason"]


def test_worker_holding_the_gil_is_not_evicted_even_when_a_peer_reports_it(etcd_server, workers):
    # Keepalive pings are answered by gRPC's C core without the GIL: a busy worker stays in, and a
    # peer's report (its probe goes unanswered: the client's Python thread cannot run) defers to
    # keepalive instead of evicting it. The reporter's ring is broken all the same, so the world
    # is re-formed with the same members.
    s = etcd_server(heartbeat_timeout_s=1.0)
    job = unique("job")
    busy = workers([s.address], job, "busy", min_np=2, max_np=2, hold_gil_s=2.0)
    calm = make_client(s.address, "calm", job_id=job, spec=JobSpec(min_np=2, max_np=2))
    calm.join()
    try:
        v = calm.wait_world(timeout_s=10.0).world_version   # min_np=2: the first world has both
        holding = busy.wait_event(lambda e: e["event"] == "holding", 10.0, "GIL holding")
        # "holding" is printed just before the GIL-bound call; a report racing into those few ms
        # may still get its probe answered (also a correct "not evicted"). Report, about the
        # current world each time, until one lands inside the hold: that one must wait for
        # keepalive (~the heartbeat timeout).
        waits = []
        while not waits or waits[-1] < 1.0 - 0.1:
            assert len(waits) < 3, waits
            reported_at = time.time()
            current = status(s.address, job).world_version
            assert calm.report_failure("busy", current, "ring peer timed out") is False
            waits.append(time.time() - reported_at)
        released = busy.wait_event(lambda e: e["event"] == "released", 20.0, "GIL released")
        assert released["t"] - holding["t"] > 1.0, "the worker must hold the GIL past the timeout"
        assert not [e for e in busy.events if e["event"] == "ended"], "the busy worker must not be evicted"
        nxt = calm.wait_world(timeout_s=10.0, min_version=v + 1)
        assert sorted(m.worker_id for m in nxt.peers) == ["busy", "calm"]
    finally:
        calm.close()


def test_stopped_worker_reported_by_a_peer_is_evicted_within_heartbeat_timeout(etcd_server, workers):
    s = etcd_server(heartbeat_timeout_s=1.5)
    job = unique("job")
    stopped = workers([s.address], job, "stopped", min_np=2, max_np=2)
    calm = make_client(s.address, "calm", job_id=job, spec=JobSpec(min_np=2, max_np=2))
    calm.join()
    try:
        v = calm.wait_world(timeout_s=10.0).world_version   # min_np=2: the first world has both
        stopped.world_of_size(2)
        stopped.kill(signal.SIGSTOP)
        reported_at = time.monotonic()
        assert calm.report_failure("stopped", v, "ring peer timed out") is True
        assert time.monotonic() - reported_at < 1.5 + 0.5
    finally:
        stopped.kill(signal.SIGKILL)
        calm.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_server_restart_against_etcd_changes_no_world(etcd, tmp_path, sig):
    prefix = f"/t/{unique('restart')}"
    args = ["--etcd", etcd.endpoint, "--etcd-prefix", prefix, "--insecure",
            "--heartbeat-timeout", "3"]
    first = ServerProc(tmp_path, *args)
    job = unique("job")
    cs = [make_client([first.address], f"w{i}", job_id=job) for i in range(3)]
    v = join_world(cs, timeout_s=20)
    first.signal(sig)
    if sig == signal.SIGTERM:
        assert first.wait(10) == 0, first.log()
        assert "stopping (signal)" in first.log()
    first.kill()
    second = ServerProc(tmp_path, *args, port=first.port)  # same address: clients reattach
    try:
        job_status = wait_until(
            lambda: _all_attached(second.address, job, 3), 15.0, "all 3 workers reattached")
        assert job_status.world_version == v and job_status.phase == "RUNNING"
        assert [m.member.worker_id for m in job_status.members] == ["w0", "w1", "w2"]
        assert not [e for c in cs for e in _drain(c) if isinstance(e, Abort)]
    finally:
        for c in cs:
            c.close()
        second.kill()


def test_leader_failover_between_replicas_changes_no_world(etcd, tmp_path):
    prefix = f"/t/{unique('failover')}"
    args = ["--etcd", etcd.endpoint, "--etcd-prefix", prefix, "--insecure",
            "--heartbeat-timeout", "3"]
    a = ServerProc(tmp_path, *args)
    wait_until(lambda: _leader_id(a.address), 10.0, "replica A to lead")
    b = ServerProc(tmp_path, *args)
    try:
        assert _leader_id(b.address) == ""  # a follower
        job = unique("job")
        cs = [make_client([b.address, a.address], f"w{i}", job_id=job) for i in range(3)]
        # b answers UNAVAILABLE + leader hint; the clients go to a.
        v = join_world(cs, timeout_s=20)
        a.signal(signal.SIGKILL)
        job_status = wait_until(lambda: _all_attached(b.address, job, 3), 15.0,
                                "workers reattached to replica B")
        assert job_status.world_version == v
        assert not [e for c in cs for e in _drain(c) if isinstance(e, Abort)]
        cs[0].close()                    # the new leader evicts as before
        assert wait_until(lambda: status(b.address, job).world_version == v + 1, 5.0,
                          f"world {v + 1}")
        for c in cs[1:]:
            c.close()
    finally:
        a.kill()
        b.kill()


def _leader_id(address):
    try:
        with grpc.insecure_channel(address) as ch:
            return pb_grpc.RendezvousStub(ch).Status(pb.StatusRequest(), timeout=2).leader_id
    except grpc.RpcError:
        return None


def _all_attached(address, job, n):
    try:
        st = status(address, job)
    except (grpc.RpcError, IndexError):
        return None
    return st if len(st.members) == n and all(m.attached for m in st.members) else None


def _drain(client):
    out = []
    while (ev := client.next_event(0)) is not None:
        out.append(ev)
    return out


def test_worker_that_died_during_server_outage_is_evicted_after_reattach_grace(etcd, tmp_path):
    prefix = f"/t/{unique('grace')}"
    args = ["--etcd", etcd.endpoint, "--etcd-prefix", prefix, "--insecure",
            "--heartbeat-timeout", "1.5", "--leader-ttl", "1"]
    first = ServerProc(tmp_path, *args)
    job = unique("job")
    cs = [make_client([first.address], f"w{i}", job_id=job) for i in range(3)]
    v = join_world(cs, timeout_s=20)
    first.signal(signal.SIGKILL)
    first.kill()
    cs[2].close()                      # dies while no server runs: nobody sees its stream break
    second = ServerProc(tmp_path, *args, port=first.port)
    try:
        seen = []
        deadline = time.monotonic() + 15.0
        while not (seen and isinstance(seen[-1], WorldInfo) and seen[-1].world_version > v):
            ev = cs[0].next_event(deadline - time.monotonic())
            assert ev is not None, f"no world {v + 1} within 15 s; events {seen}"
            seen.append(ev)
        assert [m.worker_id for m in seen[-1].peers] == ["w0", "w1"]
        (abort,) = [e for e in seen if isinstance(e, Abort)]
        assert abort.world_version == v and "w2" in abort.reason
        # Window: heartbeat timeout 1.5 + leader TTL 1 + reconnect allowance 2 s.
        assert "did not reattach within 4.5 s of a leader change" in abort.reason
        other = cs[1].wait_world(timeout_s=5.0, min_version=v + 1)
        assert (other.world_version, other.rank) == (seen[-1].world_version, 1)
    finally:
        for c in cs[:2]:
            c.close()
        second.kill()


def test_leader_whose_etcd_link_stalls_steps_down_and_no_worker_is_evicted(etcd, tmp_path):
    """Replica A reaches etcd through a proxy that freezes; clients still reach A. A must stop serving
    before etcd expires its lease, so the workers move to B in time; B must evict nobody and
    blacklist no host."""
    proxy = StallProxy(int(etcd.endpoint.rsplit(":", 1)[1]))
    prefix = f"/t/{unique('stall')}"
    common = ["--etcd-prefix", prefix, "--insecure", "--heartbeat-timeout", "3"]
    a = ServerProc(tmp_path, "--etcd", proxy.endpoint, *common)
    b = None
    cs = []
    try:
        wait_until(lambda: _leader_id(a.address), 10.0, "replica A to lead")
        b = ServerProc(tmp_path, "--etcd", etcd.endpoint, *common)
        job = unique("job")
        cs = [make_client([a.address, b.address], f"w{i}", job_id=job, host=f"h{i}")
              for i in range(3)]
        v = join_world(cs, timeout_s=20)
        proxy.stall()
        stalled_at = time.monotonic()
        job_status = wait_until(lambda: _all_attached(b.address, job, 3), 15.0,
                                "all workers reattached to replica B")
        print(f"etcd link of the leader stalled -> all workers on the new leader: "
              f"{time.monotonic() - stalled_at:.2f} s")
        assert "lost leadership" in a.log() and "no lease refresh acknowledged" in a.log()
        assert job_status.world_version == v and job_status.phase == "RUNNING"
        assert list(job_status.blacklisted_hosts) == []
        events = [e for c in cs for e in _drain(c)]
        assert not [e for e in events if isinstance(e, (Abort, Ended))], events
    finally:
        for c in cs:
            c.close()
        proxy.resume()
        a.kill()
        if b is not None:
            b.kill()
        proxy.close()
