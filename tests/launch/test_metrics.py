"""elastic-run --metrics-port and --events with a real launcher, real workers and real signals:
the workers' metrics scraped and parsed as Prometheus text, the event log read back."""

from __future__ import annotations

import pytest
import json
import os
import re
import signal
import socket
import urllib.request
from typing import Dict, FrozenSet, Tuple

from prometheus_client.parser import text_string_to_metric_families

from elastic.launch.host_metrics import WorkerMetrics
from elastic.runtime.worker_metrics import Recorder

from .launch_helpers import wait_until

Samples = Dict[Tuple[str, FrozenSet[Tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels) -> float:
    """The one sample ``name`` whose labels include ``labels`` (None when there is none)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None


def workers_in(samples: Samples) -> set:
    return {dict(ls)["worker"] for (n, ls) in samples if n == "elastic_world_version"}


def metrics_port(p) -> int:
    return int(p.wait_for(r"metrics of this host's workers on http://127\.0\.0\.1:(\d+)/metrics", 30).group(1))


def stop(p) -> None:
    p.proc.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM, p.text()
    p.wait_no_leftovers()


@pytest.mark.slow
def test_metrics_show_every_worker_training_with_rank_world_and_transport(launch):
    p = launch("--np", "2", "--host", "hA", "--metrics-port", "0", LW_STEPS="100000")
    port = metrics_port(p)
    p.wait_training(2)
    s = wait_until(lambda: (lambda s: s if all((value(s, "elastic_worker_steps_total", worker=w) or 0) >= 2
                                                for w in ("hA-0", "hA-1")) else None)(scrape(port)),
                   30, "both workers to report commits")
    ranks = {dict(ls)["rank"] for (n, ls) in s if n == "elastic_world_version"}
    assert ranks == {"0", "1"}
    for w in ("hA-0", "hA-1"):
        assert value(s, "elastic_world_version", worker=w) >= 1
        assert value(s, "elastic_world_size", worker=w) == 2
        # Same host: the ring's links run over shared memory; every step allreduces 16 bytes.
        calls = value(s, "elastic_allreduce_calls_total", worker=w, transport="shm")
        assert calls >= 2 and value(s, "elastic_allreduce_bytes_total", worker=w, transport="shm") >= 16 * 2
        assert value(s, "elastic_allreduce_seconds_total", worker=w, transport="shm") > 0
        assert value(s, "elastic_commit_seconds_count", worker=w) >= 1
        assert value(s, "elastic_sync_seconds_count", worker=w) == 1
        assert value(s, "elastic_worker_committed_step", worker=w) >= 1
        assert value(s, "elastic_recoveries_total", worker=w) == 0
    assert value(s, "elastic_workers_alive") == 2
    assert value(s, "elastic_metrics_snapshots_total") >= 2
    stop(p)


@pytest.mark.slow
def test_a_sigkilled_worker_is_counted_as_a_recovery_and_a_restart_of_its_slot(launch):
    p = launch("--np", "3", "--min-np", "1", "--host", "hA", "--max-restarts", "1", "--metrics-port", "0",
               LW_STEPS="100000")
    port = metrics_port(p)
    p.wait_training(3)
    before = wait_until(lambda: (lambda s: s if workers_in(s) == {"hA-0", "hA-1", "hA-2"} else None)(scrape(port)),
                        30, "three workers' snapshots")
    version = max(value(before, "elastic_world_version", worker=w) for w in ("hA-0", "hA-1", "hA-2"))
    p.kill_worker("hA-1")
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hA-1-r1", 30)

    def recovered():
        s = scrape(port)
        done = all((value(s, "elastic_recoveries_total", worker=w) or 0) >= 1 for w in ("hA-0", "hA-2")) and \
            "hA-1-r1" in workers_in(s) and \
            all(value(s, "elastic_world_version", worker=w) > version for w in ("hA-0", "hA-2", "hA-1-r1"))
        return s if done else None

    s = wait_until(recovered, 30, "the survivors to report their recovery")
    assert "hA-1" not in workers_in(s)            # the dead worker's series are gone
    for w in ("hA-0", "hA-2"):
        assert value(s, "elastic_recovery_seconds_count", worker=w) >= 1
        assert 0 < value(s, "elastic_recovery_seconds_sum", worker=w) < 60
        assert value(s, "elastic_steps_redone_total", worker=w) == 0   # a survivor held the newest commit
        assert value(s, "elastic_restores_total", worker=w) >= 1       # an ObjectState always restores
    # The newcomer recovered nothing: it started fresh and synced.
    assert value(s, "elastic_recoveries_total", worker="hA-1-r1") == 0
    assert value(s, "elastic_worker_restarts_total", slot="1") == 1
    assert value(s, "elastic_worker_restarts_total", slot="0") is None
    assert value(s, "elastic_workers_alive") == 3
    stop(p)


def _worker_env(pid: int) -> Dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode(errors="replace") for k, v in items}


@pytest.mark.slow
def test_forged_oversized_and_garbage_snapshots_are_dropped_and_counted(launch):
    p = launch("--np", "2", "--host", "hA", "--metrics-port", "0", LW_STEPS="100000")
    port = metrics_port(p)
    p.wait_training(2)
    env = _worker_env(p.worker_pid("hA-0"))
    path, token = env["ELASTIC_METRICS_SOCKET"], env["ELASTIC_METRICS_TOKEN"]
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    wait_until(lambda: value(scrape(port), "elastic_worker_steps_total", worker="hA-0"), 30, "hA-0's first snapshot")

    forged = Recorder("hA-0", token)
    forged.steps = 10 ** 9
    sends = {
        "oversized": [b"{" + b" " * 70000 + b"}"],
        "not_json": [b"\x00\xff garbage", b'{"steps": Infinity}'],
        "schema": [json.dumps({"worker": "hA-0"}).encode()],
        "unknown_worker": [Recorder("hZ-7", token).snapshot()],
        "bad_token": [Recorder("hA-0", "0" * 32).snapshot(), Recorder("hA-1", token).snapshot()],
        # The right token, stolen from the worker's environment, but not sent by its process group.
        "sender": [forged.snapshot()],
    }
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for datagrams in sends.values():
            for d in datagrams:
                s.sendto(d, path)

    def all_counted():
        m = scrape(port)
        return m if all(value(m, "elastic_metrics_snapshots_dropped_total", reason=r) == len(ds)
                        for r, ds in sends.items()) else None

    m = wait_until(all_counted, 15, "every bad datagram to be counted")
    assert value(m, "elastic_worker_steps_total", worker="hA-0") < 10 ** 9
    assert "hZ-7" not in workers_in(m)
    # The launcher goes on: its workers still train and still report.
    steps = value(m, "elastic_worker_steps_total", worker="hA-0")
    wait_until(lambda: value(scrape(port), "elastic_worker_steps_total", worker="hA-0") > steps, 30,
               "hA-0 to report more commits")
    assert p.proc.poll() is None
    stop(p)


@pytest.mark.slow
def test_help_explains_the_metrics_and_events_flags(launch):
    p = launch("--help")
    assert p.wait(30) == 0
    text = " ".join(" ".join(p.stdout).split())
    for needle in ("--metrics-port P", "no port per worker", "--metrics-host ADDR", "--events FILE", "worker_exited",
                   "ELASTIC_METRICS_SOCKET", "ELASTIC_METRICS_TOKEN"):
        assert needle in text, needle


@pytest.mark.slow
def test_bad_metrics_and_events_flags_are_one_line_errors(launch, tmp_path):
    cases = [
        (["--metrics-port", "70000"], r"--metrics-port 70000 is outside 0\.\.65535"),
        (["--metrics-host", "127.0.0.1"], r"--metrics-host needs --metrics-port"),
        (["--metrics-port", "0", "--metrics-host", "203.0.113.9"], r"--metrics-host 203\.0\.113\.9: cannot listen"),
        (["--events", str(tmp_path / "no-such-dir" / "events.jsonl")], r"--events .*: cannot open for appending"),
        (["--events", str(tmp_path)], r"--events .*: give a file to append to, not a directory"),
    ]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        cases.append((["--metrics-port", str(taken)],
                      rf"--metrics-port {taken}: 127\.0\.0\.1:{taken} is already in use"))
        for args, message in cases:
            p = launch("--np", "1", *args)
            assert p.wait(30) == 2, p.text()
            assert len(p.stderr) == 1 and p.stdout == [], p.text()
            assert re.match(r"elastic-run: error: " + message, p.stderr[0]), p.stderr[0]


@pytest.mark.slow
def test_the_event_log_of_a_kill_and_respawn_holds_exactly_what_happened_in_order(launch, tmp_path):
    events = tmp_path / "events.jsonl"
    # --min-np is --np: every world has all three (no first world of whoever joined first, no
    # world of two after the kill), so what happens, and its order, is fixed.
    p = launch("--np", "3", "--host", "hA", "--max-restarts", "1", "--events", str(events), LW_STEPS="150")
    p.wait_training(3)
    p.kill_worker("hA-1")
    p.wait_for(r"world \d+: 3 worker\(s\); left: hA-1; joined: hA-1-r1", 30)
    p.wait_for(r"^\[hA-1-r1\] step \d+ size 3$", 30, stream="out")
    p.finish()
    assert p.wait(90) == 0, p.text()
    lines = events.read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert all(r["job_id"] == "default" and r["host"] == "hA" and isinstance(r["time"], float) for r in recs)
    assert [r["time"] for r in recs] == sorted(r["time"] for r in recs)

    def key(r):
        e = r["event"]
        if e in ("worker_started", "worker_respawned"):
            return (e, r["worker_id"])
        if e == "worker_exited":
            return (e, r["worker_id"], r["signal"] or r["code"])
        if e == "world_formed":
            return (e, r["size"])
        return (e,)

    got = [key(r) for r in recs]
    assert got[:-4] == [("worker_started", "hA-0"), ("worker_started", "hA-1"), ("worker_started", "hA-2"),
                        ("world_formed", 3), ("worker_exited", "hA-1", "SIGKILL"), ("worker_respawned", "hA-1-r1"),
                        ("world_formed", 3), ("recovery",)], got
    # The three last workers end in any order, then the job.
    assert sorted(got[-4:-1]) == [("worker_exited", "hA-0", 0), ("worker_exited", "hA-1-r1", 0),
                                  ("worker_exited", "hA-2", 0)], got
    assert got[-1] == ("job_finished",)
    by = {r["event"]: r for r in recs}
    assert 0 < by["recovery"]["seconds"] < 30 and "hA-1 killed by SIGKILL" in by["recovery"]["after"]
    assert by["worker_respawned"]["replaces"] == "hA-1" and by["worker_respawned"]["slot"] == 1
    worlds = [r["world_version"] for r in recs if r["event"] == "world_formed"]
    assert worlds == sorted(set(worlds))          # each world once, versions growing
    assert by["job_finished"]["exit_code"] == 0 and by["job_finished"]["phase"] == "SUCCEEDED"
    assert by["job_finished"]["recoveries"] == 1


def test_the_receiver_takes_a_workers_snapshot_only_from_its_process_group_and_ignores_late_ones():
    m = WorkerMetrics("127.0.0.1", 0)
    try:
        env = m.worker_env("hA-0")
        m.attach("hA-0", os.getpgid(0))         # this test's own process group stands for the worker's
        snap = Recorder("hA-0", env["ELASTIC_METRICS_TOKEN"]).snapshot()
        assert m.take(snap, (os.getpid(), os.getuid() + 1)) == "sender"   # another user
        assert m.take(snap, None) == "sender"                              # no credentials
        assert m.take(snap, (os.getpid(), os.getuid())) is None
        assert set(m.snapshots()) == {"hA-0"}
        m.detach("hA-0")
        # Its last snapshot, still queued when it was reaped: neither kept nor counted as a forgery.
        assert m.take(snap, (os.getpid(), os.getuid())) == "late"
        assert m.snapshots() == {}
        assert m.dropped["sender"] == 2 and sum(m.dropped.values()) == 2
        assert m.accepted == 1 and m.alive == 0
    finally:
        m.close()
    assert not os.path.exists(os.path.dirname(m.socket_path))


@pytest.mark.slow
def test_a_graceful_leave_is_logged_as_preempted_and_counted_as_no_recovery(launch, tmp_path):
    events = tmp_path / "events.jsonl"
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", "--metrics-port", "0", "--events", str(events),
               LW_STEPS="100000")
    port = metrics_port(p)
    p.wait_training(3)
    p.kill_worker("hA-2", signal.SIGTERM)
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2", 30)

    def shrunk():
        s = scrape(port)
        return s if workers_in(s) == {"hA-0", "hA-1"} and \
            all(value(s, "elastic_world_size", worker=w) == 2 for w in ("hA-0", "hA-1")) else None

    s = wait_until(shrunk, 30, "the survivors to report the world of 2")
    assert value(s, "elastic_worker_restarts_total", slot="2") is None
    stop(p)
    recs = [json.loads(line) for line in events.read_text().splitlines()]
    # A world of three, then of two after the leave; a first world of two comes before when the
    # third worker starts after the settle window (a loaded machine).
    worlds = [r["size"] for r in recs if r["event"] == "world_formed"]
    assert worlds[-2:] == [3, 2] and len(worlds) <= 3, worlds
    for w in ("hA-0", "hA-1"):
        assert value(s, "elastic_recoveries_total", worker=w) == 0      # a clean leave keeps the state
        # One sync per world it was in: the last two at least, and at most every world.
        assert 2 <= value(s, "elastic_sync_seconds_count", worker=w) <= len(worlds)
    names = [(r["event"], r.get("worker_id")) for r in recs]
    assert names.index(("worker_exited", "hA-2")) < names.index(("preempted", "hA-2"))
    left = next(r for r in recs if r["event"] == "worker_exited" and r["worker_id"] == "hA-2")
    assert left["code"] == 0 and left["signal"] is None
    assert not any(r["event"] in ("recovery", "worker_respawned") for r in recs), \
        [(r["event"], r.get("worker_id"), r.get("after")) for r in recs]
    assert recs[-1]["event"] == "job_finished" and recs[-1]["exit_code"] == 128 + signal.SIGTERM


class Receiver:
    """A real WorkerMetrics whose one worker, hA-0, is this test's own process group: datagrams go
    through its Unix socket and its receiver thread, as a worker's do."""

    def __init__(self):
        self.m = WorkerMetrics("127.0.0.1", 0)
        self.token = self.m.worker_env("hA-0")["ELASTIC_METRICS_TOKEN"]
        self.m.attach("hA-0", os.getpgid(0))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def seen(self) -> int:
        with self.m._lock:
            return self.m.accepted + sum(self.m.dropped.values())

    def send(self, data: bytes) -> None:
        """Sends one datagram and waits until the receiver has taken or counted it."""
        before = self.seen()
        self.sock.sendto(data, self.m.socket_path)
        wait_until(lambda: self.seen() > before, 5, "the datagram to be taken or counted")

    def close(self) -> None:
        self.sock.close()
        self.m.close()


def _snapshot_doc(token: str) -> dict:
    return json.loads(Recorder("hA-0", token).snapshot())


def test_a_lone_surrogate_token_is_dropped_as_a_bad_token_and_the_receiver_goes_on():
    r = Receiver()
    try:
        doc = _snapshot_doc(r.token)
        doc["token"] = "\ud800"
        r.send(json.dumps(doc).encode())   # ensure_ascii: the datagram says "\ud800"
        assert b'"token":"\\ud800"' in json.dumps(doc, separators=(",", ":")).encode()
        assert r.m.dropped["bad_token"] == 1
        r.send(Recorder("hA-0", r.token).snapshot())
        assert r.m.accepted == 1 and set(r.m.snapshots()) == {"hA-0"}, "the receiver thread still takes snapshots"
        assert r.m._thread.is_alive()
    finally:
        r.close()


@pytest.mark.slow
def test_the_receiver_survives_any_datagram_and_counts_every_one():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    r = Receiver()
    good = _snapshot_doc(r.token)
    text = st.text(st.characters(exclude_categories=()), max_size=20)   # surrogates included
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                          max_leaves=12)
    # Snapshots with one field replaced by any JSON value, documents of any shape, and raw bytes.
    mutated = st.tuples(st.sampled_from(sorted(good)), values, st.booleans()).map(
        lambda f: json.dumps({**good, f[0]: f[1]}, ensure_ascii=f[2]).encode("utf-8", "surrogatepass"))
    datagrams = st.one_of(mutated, values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=9000))
    try:
        sent = {"n": 0}

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(datagrams)
        def one(data):
            before = r.seen()
            r.send(data)
            sent["n"] += 1
            assert r.seen() == before + 1, "each datagram is taken or dropped and counted exactly once"

        one()
        assert sent["n"] >= 100 and r.m._thread.is_alive()
        assert r.m.dropped["error"] == 0, "every datagram was judged by parse_snapshot, none escaped it"
        before = r.m.accepted
        r.send(Recorder("hA-0", r.token).snapshot())
        assert r.m.accepted == before + 1
    finally:
        r.close()


def _soft_open_files_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


@pytest.mark.slow
def test_a_flood_of_idle_metrics_connections_from_another_user_changes_nothing_for_the_job(launch):
    from tests.flood import Flood, connections_from, open_descriptors, other_user

    other_user()   # skipped (with its reason) unless root
    # The usual limits of a login (1,024 soft): the launcher raises its own soft limit at start.
    p = launch("--np", "2", "--host", "hA", "--max-restarts", "1", "--metrics-port", "0",
               prefix=["prlimit", "--nofile=1024:4096", "--"], LW_STEPS="600", LW_SLEEP="0.05")
    port = metrics_port(p)
    p.wait_training(2)
    raised = _soft_open_files_limit(p.proc.pid)
    flood = Flood("127.0.0.1", port, n=1100)
    try:
        # At full strength: the launcher closes what is beyond its cap (or, without a cap, holds them all).
        wait_until(lambda: flood.reopened >= 100 or open_descriptors(p.proc.pid) >= 1000, 90,
                   "the flood to saturate the metrics port")
        held = connections_from(flood.uid, port)
        fds = open_descriptors(p.proc.pid)
        p.kill_worker("hA-1")
        p.wait_for(r"world \d+: 2 worker\(s\);.* joined: hA-1-r1", 60)
        flood.wait_rounds(2)
        p.finish()
        assert p.wait(180) == 0, p.text()
    finally:
        flood.stop()
    assert fds < 200, f"the launcher held {fds} descriptors under the flood ({held} connections held)"
    assert flood.reopened > 0, "the launcher closed idle connections beyond its cap"
    assert "Too many open files" not in p.text()
    assert raised == 4096, "the launcher raised its soft limit on open files to the hard limit"
