"""`serve --metrics-port`: the replica's Prometheus metrics, scraped over HTTP during real jobs
(real gRPC servers, real etcd, real worker processes and signals) and parsed with
prometheus_client's own parser."""
from __future__ import annotations

import signal
import socket
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rendezvous.server import decision as d
from rendezvous.server.server_metrics import job_counts
from rendezvous.wire.messages import pb, pb_grpc
from rendezvous.server.store import EtcdStore, MemoryStore, StoreError

from .rdzv_helpers import (REPO, ServerProc, ServerThread, child_env, join_world, make_client, server_config, unique,
                           wait_until, wait_world_of)


def scrape(port: int) -> dict:
    """{(sample name, ((label, value), ...)): value} of http://127.0.0.1:port/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------- pure functions
@pytest.mark.parametrize("cause, label", [
    (d.Departure.LEFT, None),                       # a clean leave is no eviction
    (d.Departure.STRAGGLER, None),                  # nor is a straggler's leave (--straggler-policy evict)
    (d.Departure.STREAM_BROKEN, "stream_broken"),
    (d.Departure.NO_WATCH, "no_watch"),
    (d.Departure.REPORTED, "report"),
    (d.Departure.UNUSABLE_ADDRESS, "unusable_address"),
    (d.Departure.REJOINED, "session_replaced"),
    (d.Departure.FAILED, "other"),
])
def test_each_way_a_session_ends_has_one_eviction_cause_label(cause, label):
    assert cause.eviction == label


def test_every_departure_is_mapped_and_labels_are_distinct():
    labels = [c.eviction for c in d.Departure if c.eviction is not None]
    clean = {d.Departure.LEFT, d.Departure.STRAGGLER}   # the leaves: no eviction
    assert all(c.eviction is None for c in clean)
    assert len(labels) == len(set(labels)) == len(d.Departure) - len(clean)


def _state(world, registered, max_np):
    workers = {w: d.Worker(w, "h", "h:1", -1, i, 0.0) for i, w in enumerate(registered)}
    members = tuple(d.Member(w, "h", "h:1", r, r, len(world), 0, 1, -1) for r, w in enumerate(world))
    return d.JobState("j", d.JobSpec(1, max_np, 60.0), 0.0, phase=d.Phase.RUNNING, world_version=1,
                      world=members, workers=workers)


@pytest.mark.parametrize("world, registered, max_np, counts", [
    (["a", "b"], ["a", "b"], 8, (2, 0, 0)),             # everyone in the world
    (["a", "b"], ["a", "b", "c"], 8, (2, 0, 1)),        # c enters at the next re-form
    (["a", "b"], ["a", "b", "c", "d"], 3, (2, 1, 1)),   # room for one: the other is a hot spare
    (["a", "b"], ["a", "c"], 2, (1, 0, 1)),             # b evicted: c takes its place
    ([], ["a"], 8, (0, 0, 1)),                          # no world yet
])
def test_job_counts_split_workers_into_members_standby_and_pending(world, registered, max_np,
                                                                    counts):
    assert job_counts(_state(world, registered, max_np)) == counts


# ----------------------------------------------------------------------------------- real jobs
@pytest.mark.slow
def test_sigkilled_worker_is_counted_by_cause_with_one_recovery_and_a_newer_world(etcd, workers):
    s = ServerThread(server_config(metrics_port=0), lambda: EtcdStore([etcd.endpoint]))
    try:
        port = s.server.metrics_port
        job = unique("job")
        ws = [workers([s.address], job, f"w{i}", min_np=2) for i in range(3)]
        v = max(w.world_of_size(3)["version"] for w in ws)
        before = scrape(port)
        assert value(before, "elastic_rendezvous_leader") == 1
        assert value(before, "elastic_rendezvous_job_world_version", job_id=job) == v
        assert value(before, "elastic_rendezvous_job_members", job_id=job) == 3
        assert value(before, "elastic_rendezvous_jobs", state="RUNNING") == 1
        assert value(before, "elastic_rendezvous_failure_to_world_seconds_count") == 0
        assert value(before, "elastic_rendezvous_rpcs_total", method="Join", code="OK") == 3

        ws[1].kill(signal.SIGKILL)
        for w in (ws[0], ws[2]):
            w.world(v + 1, timeout_s=10.0)
        after = wait_until(lambda: (m := scrape(port)) and value(
            m, "elastic_rendezvous_worlds_announced_total") > value(
            before, "elastic_rendezvous_worlds_announced_total") and m, 5.0, "the next world counted")
        assert value(after, "elastic_rendezvous_evictions_total", cause="stream_broken") == 1
        assert sum(value(after, "elastic_rendezvous_evictions_total", cause=c)
                   for c in (c.eviction for c in d.Departure) if c) == 1
        assert value(after, "elastic_rendezvous_failure_to_world_seconds_count") == 1
        assert value(after, "elastic_rendezvous_failure_to_world_seconds_sum") > 0
        assert value(after, "elastic_rendezvous_job_world_version", job_id=job) == v + 1
        assert value(after, "elastic_rendezvous_job_members", job_id=job) == 2
        # The killed worker's Watch ended when its connection broke.
        assert value(after, "elastic_rendezvous_rpcs_total", method="Watch", code="CANCELLED") >= 1
        assert value(after, "elastic_rendezvous_rpc_seconds_count", method="Join") == 3
        # The store is etcd: every job write is timed there, none failed.
        assert value(after, "elastic_rendezvous_store_operation_seconds_count", operation="commit") >= 2
        assert value(after, "elastic_rendezvous_store_errors_total", operation="commit") == 0
    finally:
        s.stop()


def test_a_standby_failing_starts_no_recovery_clock():
    from rendezvous.wire.membership import JobSpec

    s = ServerThread(server_config(metrics_port=0), MemoryStore)
    try:
        port, job = s.server.metrics_port, unique("job")
        cs = [make_client(s.address, f"w{i}", job_id=job, spec=JobSpec(min_np=1, max_np=2))
              for i in range(3)]
        for c in cs:
            c.join()
        wait_world_of(cs[:2], 2)
        m = wait_until(lambda: (m := scrape(port)) and value(
            m, "elastic_rendezvous_job_standby_workers", job_id=job) == 1 and m, 5.0, "a standby")
        assert value(m, "elastic_rendezvous_job_members", job_id=job) == 2
        cs[2].close()                       # the hot spare: no world changes
        wait_until(lambda: value(scrape(port), "elastic_rendezvous_evictions_total",
                                 cause="stream_broken") == 1, 5.0, "the spare's eviction")
        assert s.service.jobs[job].liveness.failure_at is None   # no world waits on the spare
        cs[1].close()                       # a member: the next world is the recovery
        cs[0].wait_world(timeout_s=10.0, min_version=2)
        m = wait_until(lambda: (m := scrape(port)) and value(
            m, "elastic_rendezvous_failure_to_world_seconds_count") == 1 and m, 5.0, "a recovery")
        assert value(m, "elastic_rendezvous_evictions_total", cause="stream_broken") == 2
        assert s.service.jobs[job].liveness.failure_at is None   # the clock stopped at the world
        cs[0].close()
    finally:
        s.stop()


def test_finished_job_leaves_the_per_job_series(workers):
    s = ServerThread(server_config(metrics_port=0), MemoryStore)
    try:
        job = unique("job")
        c = make_client(s.address, "a", job_id=job)
        c.join()
        w = c.wait_world(timeout_s=10.0)
        assert value(scrape(s.server.metrics_port), "elastic_rendezvous_job_members", job_id=job) == 1
        c.report_success(w.world_version)
        m = wait_until(lambda: (m := scrape(s.server.metrics_port)) and value(
            m, "elastic_rendezvous_jobs", state="SUCCEEDED") == 1 and m, 5.0, "the job finished")
        assert not [k for k in m if dict(k[1]).get("job_id") == job]
        c.close()
    finally:
        s.stop()


def test_store_errors_and_rpc_codes_are_counted_by_operation_and_method():
    s = ServerThread(server_config(metrics_port=0, token="tok"), MemoryStore)
    try:
        store = s.server.store
        real_commit = store.commit

        async def failing_put(puts, deletes=(), **kw):
            if any("/jobs/" in key for key in puts):
                raise StoreError("etcd put failed (simulated)")
            return await real_commit(puts, deletes, **kw)
        store.commit = failing_put
        join = pb.JoinRequest(job_id=unique("job"), worker_id="w", host="h",
                              ring_address="127.0.0.1:5", commit_step=-1,
                              spec=pb.JobSpec(min_np=1, max_np=2))
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.RendezvousStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Join(join, timeout=5, metadata=(("authorization", "Bearer tok"),))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as e:
                stub.Status(pb.StatusRequest(), timeout=5, metadata=(("authorization", "Bearer no"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        store.commit = real_commit
        m = scrape(s.server.metrics_port)
        assert value(m, "elastic_rendezvous_store_errors_total", operation="commit") >= 1
        assert value(m, "elastic_rendezvous_rpcs_total", method="Join", code="UNAVAILABLE") == 1
        assert value(m, "elastic_rendezvous_rpcs_total", method="Status",
                     code="UNAUTHENTICATED") == 1
    finally:
        s.stop()


def test_two_servers_in_one_process_keep_their_own_metrics():
    a = ServerThread(server_config(metrics_port=0), MemoryStore)
    b = ServerThread(server_config(metrics_port=0), MemoryStore)
    try:
        job = unique("job")
        c = make_client(a.address, "w", job_id=job)
        c.join()
        c.wait_world(timeout_s=10.0)
        ma, mb = scrape(a.server.metrics_port), scrape(b.server.metrics_port)
        assert value(ma, "elastic_rendezvous_job_members", job_id=job) == 1
        assert value(mb, "elastic_rendezvous_jobs", state="RUNNING") == 0
        assert value(ma, "elastic_rendezvous_rpcs_total", method="Join", code="OK") == 1
        assert value(mb, "elastic_rendezvous_rpcs_total", method="Join", code="OK") == 0
        c.close()
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
def test_leader_metric_flips_to_the_other_replica_after_the_leader_is_killed(etcd, tmp_path):
    prefix = f"/t/{unique('metrics-failover')}"
    common = ["--etcd", etcd.endpoint, "--etcd-prefix", prefix, "--insecure",
              "--heartbeat-timeout", "3"]
    pa, pb_ = free_port(), free_port()
    a = ServerProc(tmp_path, *common, "--metrics-port", str(pa))
    b = None
    cs = []
    try:
        wait_until(lambda: value(scrape(pa), "elastic_rendezvous_leader") == 1, 10.0, "A to lead")
        b = ServerProc(tmp_path, *common, "--metrics-port", str(pb_))
        mb = scrape(pb_)
        assert value(mb, "elastic_rendezvous_leader") == 0
        assert value(mb, "elastic_rendezvous_leader_elections_total") == 0
        job = unique("job")
        cs = [make_client([a.address, b.address], f"w{i}", job_id=job) for i in range(2)]
        v = join_world(cs)
        assert value(scrape(pa), "elastic_rendezvous_job_members", job_id=job) == 2
        a.signal(signal.SIGKILL)
        mb = wait_until(lambda: (m := scrape(pb_)) and value(m, "elastic_rendezvous_leader") == 1
                        and m, 15.0, "B to lead")
        assert value(mb, "elastic_rendezvous_leader_elections_total") == 1
        # The new leader loaded the job from etcd: same world, no eviction yet.
        assert value(mb, "elastic_rendezvous_job_world_version", job_id=job) == v
        assert value(mb, "elastic_rendezvous_store_operation_seconds_count",
                     operation="get_prefix") >= 1
    finally:
        for c in cs:
            c.close()
        a.kill()
        if b is not None:
            b.kill()


def test_serve_refuses_a_metrics_port_in_use_in_one_line(tmp_path):
    import subprocess
    import sys

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "rendezvous", "serve", "--insecure", "--port", "0",
                               "--metrics-port", str(port)], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"elastic-rendezvous: --metrics-port {port}: 127.0.0.1:{port} is already in use"]


def test_serve_help_documents_the_metrics_and_events_flags(capsys):
    from rendezvous.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--metrics-port P", "--metrics-host ADDR", "default: 127.0.0.1", "--events FILE",
                 "0 picks a free port"):
        assert text in out, text


def test_metrics_flags_left_out_mean_the_server_configs_defaults():
    from rendezvous.cli import parser, config_from_args
    from rendezvous.server.server_config import ServerConfig

    got = config_from_args(parser().parse_args(["serve", "--insecure"]))
    want = ServerConfig(insecure=True)
    assert (got.metrics_port, got.metrics_host, got.events_path) == \
        (want.metrics_port, want.metrics_host, want.events_path) == (None, "127.0.0.1", None)
    got = config_from_args(parser().parse_args(["serve", "--insecure", "--metrics-port", "9400",
                                                 "--metrics-host", "0.0.0.0"]))
    assert (got.metrics_port, got.metrics_host) == (9400, "0.0.0.0")


@pytest.mark.parametrize("args, message", [
    (["--metrics-port", "70000"], "--metrics-port 70000 is outside 0..65535"),
    (["--port", "29400", "--metrics-port", "29400"], "--metrics-port 29400 is also --port"),
])
def test_serve_refuses_a_bad_metrics_port(args, message):
    from rendezvous.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--insecure", *args])
    assert message in str(e.value.code)


@pytest.mark.slow
def test_joins_keep_working_while_another_user_floods_the_metrics_port(tmp_path):
    from rendezvous.wire.membership import JobSpec
    from rendezvous.client.worker_client import RendezvousClient
    from rendezvous.server.etcd_process import free_port
    from tests.flood import Flood, open_descriptors, other_user

    other_user()   # skipped (with its reason) unless root
    port = free_port()
    server = ServerProc(tmp_path, "--insecure", "--metrics-port", str(port),
                        prefix=["prlimit", "--nofile=1024:1024", "--"])
    flood = None
    clients = []
    try:
        flood = Flood("127.0.0.1", port, n=1100)
        # At full strength: the server closes what is beyond its cap (or, without a cap, holds them all).
        wait_until(lambda: flood.reopened >= 100 or open_descriptors(server.proc.pid) >= 1000, 90,
                   "the flood to saturate the metrics port")
        fds = open_descriptors(server.proc.pid)
        spec = JobSpec(min_np=3, max_np=3)
        clients = [RendezvousClient([server.address], job_id="flooded", worker_id=f"w{i}", host=f"h{i}",
                                    ring_address=f"127.0.0.1:{5000 + i}", spec=spec) for i in range(3)]
        for c in clients:
            c.join()
        worlds = [c.wait_world(timeout_s=30) for c in clients]
        assert [w.size for w in worlds] == [3, 3, 3] and len({w.world_version for w in worlds}) == 1
        flood.stop()
        assert value(scrape(port), "elastic_rendezvous_job_members", job_id="flooded") == 3
        assert fds < 200, f"the server held {fds} descriptors under the flood"
    finally:
        for c in clients:
            c.close()
        if flood is not None:
            flood.stop()
        server.kill()
