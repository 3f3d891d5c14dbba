"""What happened on a rendezvous replica: the event log (`serve --events FILE`) and, per job, the last
few events that Status returns (`elastic-rendezvous status --watch` shows them).

Both are written from the same calls, so the file and the live view never disagree. Membership
events are recorded when they take effect (durable, sent), as the server logs them. The recent
events of a job are kept with the credential of the job's owner and Status hands them only to the
callers that own the job; they are forgotten with the job, and when this replica stops leading (a
later owner of the same job id must not see them).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Optional

from rendezvous.server import decision as d
from rendezvous.server.description import Description
from rendezvous.common.event_log import EventLog

RECENT_PER_JOB = 50          # the most Status returns per job


@dataclasses.dataclass(frozen=True)
class RecentEvent:
    time: float              # Unix seconds
    event: str               # one of event_log.EVENTS
    world_version: int
    worker_id: str = ""
    detail: str = ""         # one short line: peer text escaped and cut (peer_text.shown)
    numbers: dict = dataclasses.field(default_factory=dict)   # the event's numeric fields


class History:
    def __init__(self, log: Optional[EventLog] = None, per_job: int = RECENT_PER_JOB):
        self.log = log if log is not None else EventLog(None)
        self._per_job = per_job
        self._recent: dict[str, tuple[str, collections.deque]] = {}   # job id -> (credential, events)

    def server(self, event: str, **fields: Any) -> None:
        """An event of the replica itself (no job)."""
        self.log.emit(event, **fields)

    def job(self, state: d.JobState, event: str, *, worker_id: str = "", detail: str = "",
            world_version: Optional[int] = None, **fields: Any) -> None:
        """An event of the job whose state is now `state` (its world's version unless told)."""
        version = state.world_version if world_version is None else world_version
        if worker_id:
            fields = {"worker_id": worker_id, **fields}
        self.log.emit(event, job_id=state.job_id, world_version=version, **fields)
        kept = self._recent.get(state.job_id)
        if kept is None or kept[0] != state.credential:   # a new owner starts a new history
            kept = self._recent[state.job_id] = (state.credential,
                                                 collections.deque(maxlen=self._per_job))
        numbers = {k: float(v) for k, v in fields.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}   # not NaN
        kept[1].append(RecentEvent(time.time(), event, version, worker_id, detail, numbers))

    def delivered(self, state: d.JobState, what: Description) -> None:
        """A durable action took effect (described by description.describe); the actions that are
        no event of their own (pending changes, aborts) are not recorded."""
        if what.event is not None:
            self.job(state, what.event, worker_id=what.worker_id, detail=what.detail,
                     world_version=what.world_version, **what.fields)

    def recent(self, job_id: str, credential: str, n: int) -> list[RecentEvent]:
        """The last `n` events of the job, oldest first, if `credential` owns them."""
        kept = self._recent.get(job_id)
        if kept is None or kept[0] != credential or n <= 0:
            return []
        return list(kept[1])[-n:]

    def forget(self, job_id: Optional[str] = None) -> None:
        """Drop one job's recent events (None: every job's)."""
        if job_id is None:
            self._recent.clear()
        else:
            self._recent.pop(job_id, None)

    def close(self) -> None:
        self.log.close()
