"""Worker metrics: plain counters a worker keeps of its own training, pushed to its launcher.

``elastic-run --metrics-port P`` serves one ``/metrics`` for all the workers of its host
(elastic/launch/host_metrics.py). It gives each worker two variables, ELASTIC_METRICS_SOCKET (a Unix
datagram socket in a directory only this user can enter) and ELASTIC_METRICS_TOKEN (random, one
per worker incarnation); ``WorkerConfig`` reads them and the session calls ``start``. A
daemon thread then sends a small JSON snapshot of the counters about once a second, and one
last at shutdown. Without those variables nothing is recorded: the session holds no recorder.

What is recorded, and where the hook sits (one line each, so the step protocol stays readable):
- allreduce calls, bytes and seconds by transport (``Communicator.allreduce_`` and the async
  pair; the seconds are the time a caller was blocked: the call, or its ``synchronize`` wait);
- commits (``State.commit``: the step count, its duration, the time between commits),
  syncs (``State.sync``);
- recoveries (``Session.run`` on a failure; closed by the next successful sync): duration from
  the failure to the state synced, commits rolled back, training time since the last commit;
- the world (``Session.form``): version, rank, size;
- the straggler score of the last commit window (``elastic.runtime.straggler_detector``): this worker's compute
  time over its world's median.

The counters are written by the training thread without a lock (a few float adds per
operation); the pusher reads them as they are, so a snapshot may be off by the operation in
flight. The snapshot's format is defined here, with ``parse_snapshot``, the pure function the
launcher checks every received datagram with: it is hostile input (size bounded, only the
names below, finite non-negative numbers, the sender's token).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
from typing import Any, Dict, Mapping, Optional, Tuple

from elastic.runtime import commit_watch

log = logging.getLogger("elastic.runtime.worker_metrics")

ENV_SOCKET = "ELASTIC_METRICS_SOCKET"
ENV_TOKEN = "ELASTIC_METRICS_TOKEN"
PUSH_EVERY_S = 1.0
MAX_SNAPSHOT_BYTES = 8192
FORMAT = 3   # 2: restores; 3: training_step

# How an allreduce ran: over TCP, over shared memory (a same-host neighbour), the hierarchical
# algorithm (shm within hosts, TCP between them), or in a world of one (no link).
TRANSPORTS = ("tcp", "shm", "hierarchical", "local")

# Upper bounds (seconds) of each histogram's buckets; the last count of a snapshot is +Inf.
BUCKETS: Dict[str, Tuple[float, ...]] = {
    "step": (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0),
    "commit": (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
    "sync": (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0),
    "recovery": (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0),
}

_INTS = ("rank", "size", "world_version", "committed_step", "training_step", "steps", "recoveries", "steps_redone",
         "restores")
_MAX_INT = 2 ** 53   # JSON numbers beyond this lose precision; no real counter gets there


class _Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds


class Recorder:
    """The counters of one worker process (one incarnation)."""

    def __init__(self, worker_id: str, token: str):
        self.worker_id, self.token = worker_id, token
        self.rank, self.size, self.world_version = -1, 0, 0
        self.committed_step, self.steps = -1, 0
        self.training_step = -1   # the training step the last commit holds (the state's step; -1: none)
        self.recoveries, self.steps_redone, self.lost_seconds = 0, 0, 0.0
        self.restores = 0   # failures that rolled the state back to the last commit (the rest kept it live)
        self.allreduce: Dict[str, list] = {}        # transport -> [calls, bytes, seconds]
        self.hist = {name: _Histogram(b) for name, b in BUCKETS.items()}
        self.last_commit_at: Optional[float] = None  # end of the last commit or sync: steps are timed from it
        self.failed_at: Optional[float] = None       # a recovery in progress since then
        self.step_at_failure = -1
        self.straggler_score: Optional[float] = None  # the last window's (None: none judged yet)
        self._comm: Any = None                       # the ring the transport below was read from
        self._flat, self._hierarchical = "tcp", False

    # -- hooks (training thread)
    def transport(self, comm: Any, nbytes: int) -> str:
        if comm is not self._comm:
            kinds = comm.link_kinds if comm.size > 1 else ()
            self._flat = "local" if comm.size <= 1 else ("shm" if "shm" in kinds else "tcp")
            self._hierarchical = comm.size > 1 and bool(comm.hierarchy.get("applies"))
            self._comm = comm
        if self._hierarchical and comm.algorithm_for(nbytes) == "hierarchical":
            return "hierarchical"
        return self._flat

    # -- what a ring tells its observer (``elastic.ring.communicator.RingObserver``)
    def allreduce_done(self, comm: Any, t: Any, started: float) -> None:
        n = t.nbytes
        r = self.row(comm, n)
        r[0] += 1
        r[1] += n
        r[2] += time.perf_counter() - started

    def allreduce_started(self, comm: Any, t: Any) -> None:
        """An async allreduce submitted: counted now; its time is counted at ``synchronize``."""
        n = t.nbytes
        r = self.row(comm, n)
        r[0] += 1
        r[1] += n

    def allreduce_waited(self, comm: Any, t: Any, started: float) -> None:
        self.row(comm, t.nbytes)[2] += time.perf_counter() - started

    def row(self, comm: Any, nbytes: int) -> list:
        kind = self.transport(comm, nbytes)
        r = self.allreduce.get(kind)
        if r is None:
            r = self.allreduce[kind] = [0, 0, 0.0]
        return r

    def commit_done(self, step: int, advanced: bool, started: float, ok: bool) -> None:
        now = time.perf_counter()
        if advanced:
            self.steps += 1
            self.committed_step = step
            if self.last_commit_at is not None:
                self.hist["step"].observe(now - self.last_commit_at)
            self.last_commit_at = now
        if ok:
            self.hist["commit"].observe(now - started)

    def sync_done(self, step: int, started: float) -> None:
        now = time.perf_counter()
        self.hist["sync"].observe(now - started)
        self.committed_step = step
        self.last_commit_at = now
        if self.failed_at is not None:
            self.recoveries += 1
            self.hist["recovery"].observe(now - self.failed_at)
            self.steps_redone += max(0, self.step_at_failure - step)
            self.failed_at = None

    def world_formed(self, version: int, rank: int, size: int) -> None:
        self.world_version, self.rank, self.size = version, rank, size

    def failure(self, step: int, kept: bool = False) -> None:
        """A failure hit at commit ``step``: a recovery starts; the state is about to be restored,
        or was ``kept`` live."""
        if not kept:
            self.restores += 1
        if self.failed_at is not None:
            return   # a failure during a recovery: still the same recovery
        now = time.perf_counter()
        self.failed_at, self.step_at_failure = now, step
        if self.last_commit_at is not None and not kept:
            self.lost_seconds += now - self.last_commit_at

    # -- the snapshot (pusher thread)
    def snapshot(self, final: bool = False) -> bytes:
        doc = {"v": FORMAT, "worker": self.worker_id, "token": self.token, "final": final,
               "rank": self.rank, "size": self.size, "world_version": self.world_version,
               "committed_step": max(self.committed_step, -1), "training_step": self.training_step,
               "steps": self.steps,
               "recoveries": self.recoveries, "steps_redone": self.steps_redone, "restores": self.restores,
               "lost_seconds": self.lost_seconds, "straggler_score": self.straggler_score,
               "allreduce": {k: list(v) for k, v in list(self.allreduce.items())},
               "hist": {k: [h.sum, *h.counts] for k, h in self.hist.items()}}
        return json.dumps(doc, separators=(",", ":")).encode()


# ---------------------------------------------------------------------- the session's recorder
class Pusher(threading.Thread):
    """Sends ``recorder``'s snapshot to the launcher about once a second, and one last at ``close``.
    A session starts one (``start``) and holds it; nothing here is process-wide."""

    def __init__(self, recorder: Recorder, path: str):
        super().__init__(name="elastic-metrics", daemon=True)
        self.recorder, self.path = recorder, path
        self.stop_event = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self._warned = False

    def send(self, final: bool = False) -> None:
        try:
            self.sock.sendto(self.recorder.snapshot(final), self.path)
        except OSError as e:   # launcher gone or busy: this snapshot is lost, the next one may pass
            if not self._warned:
                log.warning("metrics: cannot reach the launcher at %s (%s); retrying every %g s", self.path,
                            e.strerror or e, PUSH_EVERY_S)
                self._warned = True

    def run(self) -> None:
        while not self.stop_event.wait(PUSH_EVERY_S):
            self.send()

    def close(self) -> None:
        """Sends the last snapshot and stops."""
        self.stop_event.set()
        self.join(2.0)
        self.send(final=True)
        self.sock.close()


def start(socket_path: Optional[str], token: Optional[str], worker_id: str) -> Optional[Pusher]:
    """A recorder pushing to ``socket_path``, started; None (nothing recorded) without a socket."""
    if not socket_path or not token:
        return None
    pusher = Pusher(Recorder(worker_id, token), socket_path)
    pusher.start()
    return pusher


class _Timed:
    __slots__ = ("rec", "state", "what", "started", "step")

    def __init__(self, rec: Recorder, state: Any, what: str):
        self.rec, self.state, self.what = rec, state, what

    def __enter__(self) -> None:
        self.started, self.step = time.perf_counter(), self.state.commit_step

    def __exit__(self, kind, value, tb) -> None:
        step = self.state.commit_step
        self.rec.training_step = commit_watch.training_step(self.state)
        if self.what == "commit":
            # Counted even when the membership check ends it with an exception: the copy was taken.
            self.rec.commit_done(step, step != self.step, self.started, kind is None)
        elif kind is None:
            self.rec.sync_done(step, self.started)


def timed(recorder: Optional[Recorder], state: Any, what: str) -> Any:
    """``with timed(recorder, state, "commit"|"sync"):`` around a commit or a sync; nothing
    is timed without a recorder."""
    return contextlib.nullcontext() if recorder is None else _Timed(recorder, state, what)


# ---------------------------------------------------------------------- the snapshot, as received
class SnapshotRejected(ValueError):
    """A received snapshot that is not taken; ``reason`` is a short label (counted by it)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# "error": a datagram the receiver itself failed on (a bug; logged once), still dropped and counted.
REJECT_REASONS = ("oversized", "not_json", "schema", "unknown_worker", "bad_token", "sender", "error")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    worker: str
    final: bool
    rank: int
    size: int
    world_version: int
    committed_step: int
    training_step: int
    steps: int
    recoveries: int
    steps_redone: int
    restores: int
    lost_seconds: float
    straggler_score: Optional[float]                     # None: no window judged yet
    allreduce: Mapping[str, Tuple[int, int, float]]
    hist: Mapping[str, Tuple[float, Tuple[int, ...]]]   # name -> (sum, per-bucket counts, +Inf last)


def _number(value: Any, what: str, integer: bool, low: int = 0) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SnapshotRejected("schema", f"{what} is not a number")
    if integer and not isinstance(value, int):
        raise SnapshotRejected("schema", f"{what} is not an integer")
    if not math.isfinite(value) or value < low or value > _MAX_INT:
        raise SnapshotRejected("schema", f"{what} = {value!r} is out of range")
    return value if integer else float(value)


def parse_snapshot(data: bytes, tokens: Mapping[str, str]) -> Snapshot:
    """The snapshot in ``data``, from a worker whose token ``tokens`` maps its id to; raises
    ``SnapshotRejected`` for anything else (a pure function: the launcher's only parser)."""
    if len(data) > MAX_SNAPSHOT_BYTES:
        raise SnapshotRejected("oversized", f"{len(data)} bytes, at most {MAX_SNAPSHOT_BYTES}")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise SnapshotRejected("not_json", "not a UTF-8 JSON document") from None
    if not isinstance(doc, dict):
        raise SnapshotRejected("schema", "not a JSON object")
    expected = {"v", "worker", "token", "final", "lost_seconds", "straggler_score", "allreduce", "hist", *_INTS}
    if set(doc) != expected:
        extra, missing = sorted(set(doc) - expected), sorted(expected - set(doc))
        raise SnapshotRejected("schema", f"fields {extra} not known, {missing} missing"[:200])
    if doc["v"] != FORMAT:
        raise SnapshotRejected("schema", f"format {str(doc['v'])[:20]!r}, this launcher reads {FORMAT}")
    worker, token = doc["worker"], doc["token"]
    if not isinstance(worker, str) or not isinstance(token, str) or worker not in tokens:
        raise SnapshotRejected("unknown_worker", f"worker {str(worker)[:100]!r} was not started by this launcher")
    # Tokens are hex: anything else (a JSON "\ud800" decodes to a str no codec encodes) is a wrong one.
    if not token.isascii() or not hmac.compare_digest(token.encode(), tokens[worker].encode()):
        raise SnapshotRejected("bad_token", f"worker {worker!r}: wrong token")
    if not isinstance(doc["final"], bool):
        raise SnapshotRejected("schema", "final is not true or false")
    ints = {k: _number(doc[k], k, True, low=-1 if k in ("rank", "committed_step", "training_step") else 0)
            for k in _INTS}
    allreduce = doc["allreduce"]
    if not isinstance(allreduce, dict) or not set(allreduce) <= set(TRANSPORTS):
        raise SnapshotRejected("schema", f"allreduce transports must be among {', '.join(TRANSPORTS)}")
    rows = {}
    for kind, row in allreduce.items():
        if not isinstance(row, list) or len(row) != 3:
            raise SnapshotRejected("schema", f"allreduce {kind}: not [calls, bytes, seconds]")
        rows[kind] = (_number(row[0], f"allreduce {kind} calls", True),
                      _number(row[1], f"allreduce {kind} bytes", True),
                      _number(row[2], f"allreduce {kind} seconds", False))
    hist = doc["hist"]
    if not isinstance(hist, dict) or set(hist) != set(BUCKETS):
        raise SnapshotRejected("schema", f"hist must have exactly {', '.join(BUCKETS)}")
    hists = {}
    for name, values in hist.items():
        if not isinstance(values, list) or len(values) != len(BUCKETS[name]) + 2:
            raise SnapshotRejected("schema", f"hist {name}: not [sum, {len(BUCKETS[name]) + 1} bucket counts]")
        hists[name] = (_number(values[0], f"hist {name} sum", False),
                       tuple(_number(c, f"hist {name} count", True) for c in values[1:]))
    score = doc["straggler_score"]
    return Snapshot(worker=worker, final=doc["final"], lost_seconds=_number(doc["lost_seconds"], "lost_seconds", False),
                    straggler_score=None if score is None else _number(score, "straggler_score", False),
                    allreduce=rows, hist=hists, **ints)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def config_from_env(env: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """(socket path, token) from the launcher's variables; (None, None) without them."""
    path, token = env.get(ENV_SOCKET) or None, env.get(ENV_TOKEN) or None
    if (path is None) != (token is None):
        raise ValueError(f"{ENV_SOCKET} and {ENV_TOKEN} go together (elastic-run --metrics-port sets both)")
    if path is not None and not os.path.isabs(path):
        raise ValueError(f"{ENV_SOCKET}={path!r} must be an absolute path")
    return path, token
