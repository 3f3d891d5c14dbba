"""The structured event log (`--events FILE`): one JSON object per line, for log shippers.

One writer for the rendezvous daemon and the launcher, so both speak the same schema::

    {"ts": "2026-12-01T11:20:03.512Z", "time": 1796116803.512, "event": "world_formed",
     "job_id": "exp7", "world_version": 3, ...event fields...}

``ts`` is UTC (RFC 3339, milliseconds), ``time`` the same instant as Unix seconds, ``event`` one of
``EVENTS``. Lines are written whole and flushed as they happen (a shipper tailing the file never
sees half a line); a write that fails is logged once and the log goes quiet rather than taking
the process with it. Field values are checked here: only JSON scalars, lists and str-keyed dicts
pass, so nothing a peer sent can smuggle a newline or a non-JSON value into the file.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import threading
import time
from typing import Any, Optional

from rendezvous.common import files

log = logging.getLogger("elastic.events")

# Every event either side writes; anything else is a programming error, caught by the tests.
EVENTS = frozenset({
    "server_started", "server_stopped", "leader_elected", "leadership_lost",
    "job_created", "world_formed", "worker_joined", "worker_left", "worker_evicted", "ring_broken",
    "straggler_detected", "straggler_left",
    "worker_started", "worker_exited", "worker_respawned",
    "recovery", "preempted", "job_finished",
})

MAX_TEXT = 1000   # a reason longer than this is cut: one event is one readable line


def _clean(value: Any, depth: int = 0) -> Any:
    if depth > 4:
        raise ValueError("event field nested too deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return round(value, 6)
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, (list, tuple)):
        return [_clean(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k)[:100]: _clean(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"event field of type {type(value).__name__} is not JSON")


def event_record(event: str, *, job_id: Optional[str] = None, world_version: Optional[int] = None,
                 now: Optional[float] = None, **fields: Any) -> dict:
    """The dict one event line holds (pure: the writer and the tests share it)."""
    if event not in EVENTS:
        raise ValueError(f"unknown event {event!r}")
    t = time.time() if now is None else now
    stamp = datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc)
    rec = {"ts": stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z",
           "time": round(t, 3), "event": event}
    if job_id is not None:
        rec["job_id"] = str(job_id)[:MAX_TEXT]
    if world_version is not None:
        rec["world_version"] = int(world_version)
    for k, v in fields.items():
        if k in rec:
            raise ValueError(f"event field {k!r} is reserved")
        rec[k] = _clean(v)
    return rec


class EventLog:
    """Appends events to a file, one JSON line each; ``EventLog(None)`` writes nothing."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path:
            # Append: a restarted daemon continues the same log. Opened now, so a bad path is a
            # startup error naming it, not a silent loss later.
            # Not through a symbolic link: in a shared directory someone else's link would
            # have these lines appended to whatever file it names.
            try:
                fd = files.open_log(path)
            except OSError as e:
                raise ValueError(f"--events {path}: cannot open for appending: {files.reason(e)}") from None
            self._file = os.fdopen(fd, "a", encoding="utf-8", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def emit(self, event: str, *, job_id: Optional[str] = None, world_version: Optional[int] = None,
             **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps(event_record(event, job_id=job_id, world_version=world_version, **fields),
                          separators=(",", ":"), ensure_ascii=True, allow_nan=False)
        with self._lock:
            f = self._file
            if f is None:
                return
            try:
                f.write(line + "\n")
            except (OSError, ValueError) as e:
                log.error("event log %s: write failed (%s); no more events are written", self.path, e)
                self._file = None

    def close(self) -> None:
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
