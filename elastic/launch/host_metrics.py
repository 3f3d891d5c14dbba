"""`elastic-run --metrics-port`: one Prometheus `/metrics` for every worker of this host.

No port per worker: the launcher binds a Unix datagram socket in a private directory (0700,
made by ``tempfile.mkdtemp``) and gives each worker it spawns the socket's path and a random
token of its own (elastic.runtime.worker_metrics). Each worker sends a JSON snapshot of its counters about once
a second; this side keeps the last one per worker and renders them when scraped, through a
custom collector on a private registry (prometheus-client), labelled ``rank`` and ``worker``.

Every datagram is hostile input. It is taken only when it is at most
``elastic.runtime.worker_metrics.MAX_SNAPSHOT_BYTES`` long, parses as exactly the snapshot format
(``parse_snapshot``: known names, finite non-negative numbers), carries the token of a worker
this launcher started, and was sent by a process of that worker's process group (the kernel
gives the sender's pid and uid with each datagram: SO_PASSCRED). Anything else is dropped and
counted in ``elastic_metrics_snapshots_dropped_total{reason}``; nothing is ever unpickled.

A worker's series go away when it exits (counters restart with the next incarnation, which
Prometheus' rate() handles as a reset); what outlives a worker is counted by the launcher
itself: restarts per slot (``elastic_worker_restarts_total{slot}``) and workers alive.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Dict, Iterator, Optional, Tuple

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from rendezvous.common.metrics_http import MetricsServer

from elastic.runtime.worker_metrics import (BUCKETS, ENV_SOCKET, ENV_TOKEN, MAX_SNAPSHOT_BYTES, REJECT_REASONS,
                                            TRANSPORTS)
from elastic.runtime.worker_metrics import Snapshot, SnapshotRejected, parse_snapshot

log = logging.getLogger("elastic.launch")

_CREDS = struct.Struct("3i")   # struct ucred: pid, uid, gid
_GONE_KEPT = 256

# (metric name, type, help) of each worker series, in the order served.
WORKER_METRICS = (
    ("elastic_worker_steps", "counter", "Commits this worker took (one step of the commit protocol each)."),
    ("elastic_worker_step_seconds", "histogram", "Seconds from one commit (or sync) to the next commit."),
    ("elastic_worker_committed_step", "gauge", "The number of this worker's last commit (-1 before any)."),
    ("elastic_worker_training_step", "gauge", "The training step this worker's last commit holds (its state's "
                                              "step; -1 when the state counts none)."),
    ("elastic_allreduce_calls", "counter", "Allreduce calls, by transport (tcp, shm, hierarchical, local)."),
    ("elastic_allreduce_bytes", "counter", "Bytes of the buffers allreduced, by transport."),
    ("elastic_allreduce_seconds", "counter", "Seconds callers were blocked in allreduce (or its synchronize), "
                                             "by transport."),
    ("elastic_commit_seconds", "histogram", "Duration of state.commit(): snapshot and membership check."),
    ("elastic_sync_seconds", "histogram", "Duration of state.sync(): the most advanced state sent to all."),
    ("elastic_recoveries", "counter", "Recoveries from a failure: restore, next world, sync."),
    ("elastic_recovery_seconds", "histogram", "Seconds from a failure to the state synced in the next world."),
    ("elastic_steps_redone", "counter", "Commits rolled back by recoveries (commit step at the failure minus "
                                        "the step synced after it)."),
    ("elastic_recovery_lost_seconds", "counter", "Training seconds since the last commit that failures threw away."),
    ("elastic_restores", "counter", "Failures after which this worker restored its last commit; the others kept the "
                                    "live state (the failure came before the optimizer changed anything)."),
    ("elastic_world_version", "gauge", "Version of the world this worker is in (0 before the first)."),
    ("elastic_world_size", "gauge", "Workers in this worker's world."),
    ("elastic_straggler_score", "gauge", "This worker's compute time over its world's median in the last commit "
                                         "window (1: typical; a straggler stays above --straggler-factor)."),
    ("elastic_worker_snapshot_age_seconds", "gauge", "Seconds since this worker's last snapshot arrived."),
)


class _Slot:
    __slots__ = ("worker", "token", "pgid", "snapshot", "received_at")

    def __init__(self, worker: str, token: str):
        self.worker, self.token = worker, token
        self.pgid: Optional[int] = None
        self.snapshot: Optional[Snapshot] = None
        self.received_at = 0.0


class WorkerMetrics:
    """The launcher's receiver and `/metrics` endpoint; ``close()`` stops both."""

    def __init__(self, host: str, port: int):
        self._lock = threading.Lock()
        self._workers: Dict[str, _Slot] = {}
        # Tokens of workers that exited, the latest few: their last snapshot may still be in the
        # socket's queue when the launcher reaps them, and that is no forgery.
        self._gone: "collections.OrderedDict[str, str]" = collections.OrderedDict()
        self.restarts: Dict[int, int] = {}
        self.alive = 0
        self.accepted = 0
        self.dropped: Dict[str, int] = {r: 0 for r in REJECT_REASONS}
        self._dir = tempfile.mkdtemp(prefix="elastic-metrics-")   # 0700: only this user reaches the socket
        self.socket_path = os.path.join(self._dir, "workers.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(self.socket_path)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._sock.settimeout(0.2)
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))
            self._http = MetricsServer(registry, host, port, name="elastic-run-metrics-http")
        except BaseException:
            self._sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.port = self._http.port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="elastic-run-metrics", daemon=True)
        self._thread.start()

    # -- the workers this launcher runs
    def worker_env(self, worker_id: str) -> Dict[str, str]:
        """The variables a new worker gets: the socket and a fresh token of its own."""
        token = secrets.token_hex(16)
        with self._lock:
            self._workers[worker_id] = _Slot(worker_id, token)
        return {ENV_SOCKET: self.socket_path, ENV_TOKEN: token}

    def attach(self, worker_id: str, pid: int) -> None:
        """The worker's process started: its group (start_new_session: its pid) may send for it."""
        with self._lock:
            slot = self._workers.get(worker_id)
            if slot is not None:
                slot.pgid = pid
            self.alive += 1

    def detach(self, worker_id: str) -> None:
        """The worker exited: its series go, and a snapshot still in flight for it is dropped."""
        with self._lock:
            slot = self._workers.pop(worker_id, None)
            if slot is not None:
                self.alive -= 1
                self._gone[worker_id] = slot.token
                while len(self._gone) > _GONE_KEPT:
                    self._gone.popitem(last=False)

    def note_restart(self, slot: int) -> None:
        with self._lock:
            self.restarts[slot] = self.restarts.get(slot, 0) + 1

    # -- receiving
    def _receive(self) -> None:
        space = socket.CMSG_SPACE(_CREDS.size)
        while not self._stop.is_set():
            try:
                data, ancillary, flags, _ = self._sock.recvmsg(MAX_SNAPSHOT_BYTES + 1, space)
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)   # nothing a sender does should spin this thread
                continue
            try:
                self.take(data, _sender(ancillary), bool(flags & socket.MSG_TRUNC))
            except Exception:   # a case parse_snapshot missed: this thread must outlive any datagram
                with self._lock:
                    self.dropped["error"] += 1
                    first = self.dropped["error"] == 1
                if first:
                    log.exception("metrics: a datagram on %s could not be checked; dropped (counted as "
                                  "reason=\"error\", logged once)", self.socket_path)

    def take(self, data: bytes, sender: Optional[Tuple[int, int]], truncated: bool = False) -> Optional[str]:
        """Keeps the snapshot in ``data`` from ``sender`` (pid, uid), or counts why not; returns
        the reason it was dropped (None: taken; "late": from a worker already reaped, ignored)."""
        with self._lock:
            tokens = {**self._gone, **{w: s.token for w, s in self._workers.items()}}
        try:
            if truncated:
                raise SnapshotRejected("oversized", f"more than {MAX_SNAPSHOT_BYTES} bytes")
            snap = parse_snapshot(data, tokens)
            with self._lock:
                if snap.worker in self._gone and snap.worker not in self._workers:
                    return "late"   # a worker's last words, after it was reaped: not kept, not a drop
            if sender is None or sender[1] != os.getuid() or not _in_group(sender[0], self._pgid(snap.worker)):
                raise SnapshotRejected("sender", f"worker {snap.worker}: not sent by its process group")
        except SnapshotRejected as e:
            with self._lock:
                self.dropped[e.reason] += 1
            return e.reason
        with self._lock:
            slot = self._workers.get(snap.worker)
            if slot is None:   # exited meanwhile
                self.dropped["unknown_worker"] += 1
                return "unknown_worker"
            slot.snapshot, slot.received_at = snap, time.monotonic()
            self.accepted += 1
        return None

    def _pgid(self, worker_id: str) -> Optional[int]:
        with self._lock:
            slot = self._workers.get(worker_id)
            return slot.pgid if slot is not None else None

    def snapshots(self) -> Dict[str, Tuple[Snapshot, float]]:
        with self._lock:
            now = time.monotonic()
            return {w: (s.snapshot, now - s.received_at) for w, s in self._workers.items() if s.snapshot is not None}

    def close(self) -> None:
        self._stop.set()
        self._http.close()
        self._thread.join(2.0)
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _sender(ancillary) -> Optional[Tuple[int, int]]:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            pid, uid, _ = _CREDS.unpack(data[:_CREDS.size])
            return pid, uid
    return None


def _in_group(pid: int, pgid: Optional[int]) -> bool:
    if pgid is None or pid <= 0:
        return False
    try:
        return os.getpgid(pid) == pgid
    except OSError:   # gone already: cannot tell whose it was
        return False


class _Collector(Collector):
    """Renders the last snapshots when scraped (the launcher's thread never waits on it)."""

    def __init__(self, source: WorkerMetrics):
        self.source = source

    def collect(self) -> Iterator:
        src = self.source
        snaps = src.snapshots()
        fam = {}
        for name, kind, doc in WORKER_METRICS:
            extra = ["transport"] if name.startswith("elastic_allreduce_") else []
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
            fam[name] = cls(name, doc, labels=["rank", "worker", *extra])
        for worker, (s, age) in sorted(snaps.items()):
            labels = [str(s.rank) if s.rank >= 0 else "", worker]
            fam["elastic_worker_steps"].add_metric(labels, s.steps)
            fam["elastic_worker_committed_step"].add_metric(labels, s.committed_step)
            fam["elastic_worker_training_step"].add_metric(labels, s.training_step)
            for kind in TRANSPORTS:
                calls, nbytes, seconds = s.allreduce.get(kind, (0, 0, 0.0))
                if kind in s.allreduce:
                    fam["elastic_allreduce_calls"].add_metric(labels + [kind], calls)
                    fam["elastic_allreduce_bytes"].add_metric(labels + [kind], nbytes)
                    fam["elastic_allreduce_seconds"].add_metric(labels + [kind], seconds)
            for hist, name in (("step", "elastic_worker_step_seconds"), ("commit", "elastic_commit_seconds"),
                               ("sync", "elastic_sync_seconds"), ("recovery", "elastic_recovery_seconds")):
                total, counts = s.hist[hist]
                cumulative, buckets = 0, []
                for bound, count in zip((*BUCKETS[hist], float("inf")), counts):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
                fam[name].add_metric(labels, buckets, total)
            fam["elastic_recoveries"].add_metric(labels, s.recoveries)
            fam["elastic_steps_redone"].add_metric(labels, s.steps_redone)
            fam["elastic_recovery_lost_seconds"].add_metric(labels, s.lost_seconds)
            fam["elastic_restores"].add_metric(labels, s.restores)
            fam["elastic_world_version"].add_metric(labels, s.world_version)
            fam["elastic_world_size"].add_metric(labels, s.size)
            if s.straggler_score is not None:
                fam["elastic_straggler_score"].add_metric(labels, s.straggler_score)
            fam["elastic_worker_snapshot_age_seconds"].add_metric(labels, age)
        yield from fam.values()
        with src._lock:
            restarts, alive, accepted, dropped = dict(src.restarts), src.alive, src.accepted, dict(src.dropped)
        r = CounterMetricFamily("elastic_worker_restarts", "Respawns of a worker killed by a signal, by local slot.",
                                labels=["slot"])
        for slot, n in sorted(restarts.items()):
            r.add_metric([str(slot)], n)
        yield r
        yield GaugeMetricFamily("elastic_workers_alive", "Worker processes of this launcher running now.", value=alive)
        yield CounterMetricFamily("elastic_metrics_snapshots", "Worker snapshots received and kept.", value=accepted)
        d = CounterMetricFamily("elastic_metrics_snapshots_dropped", "Datagrams on the metrics socket that were not "
                                "taken, by reason (oversized, not_json, schema, unknown_worker, bad_token, sender, "
                                "error).", labels=["reason"])
        for reason, n in dropped.items():
            d.add_metric([reason], n)
        yield d
