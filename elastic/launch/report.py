"""What the launcher says about the job as it runs: new worlds (who joined, who left), recoveries
with their durations, phase changes, and which rank each worker holds. A pure function of
successive Status answers and the local events the launcher notes, so it is tested without
processes.

Durations are measured here, at the launcher: from the moment it saw a failure (a local worker
reaped, or a world member gone from Status) to the first Status answer that shows every member of
the new world having trained a step in it (their progress reports), or from a worker's start to
the world it joined. Status is polled every 0.2 s, so they are accurate to about that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from rendezvous.client.status_client import JobStatusInfo


WAIT_LINE_EVERY_S = 10.0   # while the job waits for workers to reach min-np: a line this often
STEP_WAIT_S = 30.0         # a recovered world whose members report no training step: said without it
BELOW_MIN_GRACE_S = 1.0    # below min-np this long before it is said (not while a launcher stops the job)


class Line(str):
    """A line the launcher prints. ``notable`` ones (failures, recoveries, leaves, below min-np)
    are printed even by a quiet launcher; the others are routine (a world formed, waiting)."""

    notable: bool

    def __new__(cls, text: str, notable: bool = False) -> "Line":
        line = super().__new__(cls, text)
        line.notable = notable
        return line


@dataclass(frozen=True)
class _Held:
    """A world formed after a failure, its line held until its members train a step in it."""

    version: int
    text: str
    since: float          # the failure
    what: str
    formed_at: float

    def formed_line(self) -> Line:
        return Line(f"{self.text}; formed {self.formed_at - self.since:.2f} s after {self.what}", True)


def _ids(workers) -> str:
    workers = sorted(workers)
    return ", ".join(workers[:8]) + (f" and {len(workers) - 8} more" if len(workers) > 8 else "")


class Reporter:
    def __init__(self, now: float):
        self.started = now
        self.last: Optional[JobStatusInfo] = None
        self.failure_since: Optional[float] = None
        self.failure_what = ""
        self.failure_ids: set = set()          # the members whose loss from a world is the failure noted
        self._seen_gone = False                # the failure noted is only their absence from Status
        self.departed: set = set()             # workers that left the job gracefully: no failure
        self.starts: Dict[str, float] = {}
        self.recoveries: List[float] = []      # seconds from a failure to the next world, as reported
        self.world: set = set()                # members of the last world reported
        self._broken: set = set()              # world versions whose ring_broken event was noted
        self._waiting_since: Optional[float] = None   # the job waits below min-np since (as first seen)
        self._waiting_told = 0.0
        self._below_since: Optional[float] = None    # the job is below min-np (WAITING) since
        self._below_told = False
        self._held: Optional[_Held] = None           # a world formed after a failure, until it trains
        # worker id -> (world version, rank or None on standby), as the latest answer naming it
        # said; kept after it is gone from Status, so its failure is still reported with its rank.
        self._ranks: Dict[str, Tuple[int, Optional[int]]] = {}

    def rank_of(self, worker_id: str) -> Optional[int]:
        """The worker's rank in the latest world Status showed it in (None: never, or on standby)."""
        return self._ranks.get(worker_id, (0, None))[1]

    def was_member(self, worker_id: str) -> bool:
        """Status listed the worker as a member of the job (in a world or on standby) at some point."""
        return worker_id in self._ranks

    def note_start(self, worker_id: str, now: float) -> None:
        self.starts[worker_id] = now

    def note_failure(self, what: str, now: float, ids: frozenset = frozenset(), seen_gone: bool = False) -> None:
        """A failure of ``ids`` (none: of the world as a whole) at ``now``; the first one noted
        until the next world is the one reported. ``seen_gone``: all that is known is that
        Status no longer lists them; a later note naming how the same workers ended (the
        launcher reaped them: killed by SIGKILL) says it instead, from the earlier time."""
        if self.failure_since is None:
            self.failure_since, self.failure_what, self.failure_ids = now, what, set(ids)
            self._seen_gone = seen_gone
        elif self._seen_gone and not seen_gone and ids and set(ids) == self.failure_ids:
            self.failure_what, self._seen_gone = what, False

    def note_left(self, worker_id: str) -> None:
        """The worker left the job gracefully: its absence from the next world is no failure,
        whether Status showed it gone before the launcher saw it exit or after."""
        self.departed.add(worker_id)
        if self.failure_since is not None and self.failure_ids and self.failure_ids <= self.departed:
            self.failure_since, self.failure_what, self.failure_ids = None, "", set()

    def update(self, view: JobStatusInfo, now: float) -> List[Line]:
        msgs: List[Line] = []
        current = self.last.world_version if self.last is not None else None
        for ev in view.events:   # the server's word: these left cleanly, whichever host they ran on
            if ev.event in ("worker_left", "straggler_left") and ev.worker_id:
                self.note_left(ev.worker_id)
            elif ev.event == "ring_broken" and ev.world_version == current and current not in self._broken:
                # Every member alive, the ring broken all the same (a collective timed out on a
                # busy peer): the next world re-forms the same members, after a restore.
                self._broken.add(current)
                self.note_failure(ev.detail, now)
        for m in view.members:
            if view.world_version >= self._ranks.get(m.worker_id, (-1, None))[0]:
                self._ranks[m.worker_id] = (view.world_version, m.rank)
        prev = self.last
        old = self.world
        if prev is not None and view.world_version == prev.world_version:
            present = {m.worker_id for m in view.members}
            lost = {m.worker_id for m in prev.members if m.rank is not None} - present - self.departed
            if lost:
                self.note_failure(f"{_ids(lost)} left the world", now, frozenset(lost), seen_gone=True)
        if view.world_version > 0 and view.world_version != (prev.world_version if prev else 0):
            new = {m.worker_id: m.rank for m in view.members if m.rank is not None}
            joined, left = set(new) - old, old - set(new)
            self.world = set(new)
            text = f"world {view.world_version}: {len(new)} worker(s)"
            notable = False
            if prev is None or prev.world_version == 0:
                if prev is None and view.world_version > 1:
                    text += f" (job {view.job_id} was already running)"
                else:
                    text += f", formed {now - self.started:.2f} s after launch"
            else:
                if left:
                    text += f"; left: {_ids(left)}"
                    notable = True
                if joined:
                    waits = [now - self.starts[w] for w in joined if w in self.starts]
                    text += f"; joined: {_ids(joined)}"
                    if waits:
                        text += f" ({max(waits):.2f} s after start)"
            if self._held is not None:   # a newer world came before the held one trained a step
                msgs.append(self._held.formed_line())
                if self.failure_since is None:
                    self.failure_since, self.failure_what = self._held.since, self._held.what
                self._held = None
            for w in joined:
                self.starts.pop(w, None)
            if self.failure_since is not None and prev is not None and prev.world_version != 0:
                # A recovery ends when every member of the new world has trained a step in it.
                self._held = _Held(view.world_version, text, self.failure_since, self.failure_what, now)
            else:
                msgs.append(Line(text, notable))
            self.failure_since = None
        if self._held is not None:
            line = self._recovered(view, now)
            if line is not None:
                msgs.append(line)
        # Below min-np is said once it lasts BELOW_MIN_GRACE_S: a job that stops for another reason
        # (a worker's exception ends the launcher) drops below min-np on its way out, which is no news.
        if view.phase == "WAITING":
            if self._below_since is None:
                self._below_since = now
            if not self._below_told and now - self._below_since >= BELOW_MIN_GRACE_S:
                self._below_told = True
                alive = sum(1 for m in view.members)
                msgs.append(Line(f"below min-np={view.min_np}: {alive} worker(s) left; the job fails if it stays "
                                 f"below for {view.elastic_timeout_s:g} s", True))
        else:
            if view.phase == "RUNNING" and self._below_told:
                msgs.append(Line(f"back at {len(view.ranks())} worker(s), at least min-np={view.min_np}", True))
            self._below_since, self._below_told = None, False
        waiting = self._waiting(view, now)
        if waiting:
            msgs.append(waiting)
        self.last = view
        return msgs

    def _recovered(self, view: JobStatusInfo, now: float) -> Optional[Line]:
        """The held world's line once every member stepped in it (or STEP_WAIT_S went by without)."""
        held = self._held
        ranked = [m for m in view.members if m.rank is not None]
        if view.world_version == held.version and ranked and all(m.stepped_world >= held.version for m in ranked):
            took = now - held.since
            self.recoveries.append(took)
            self._held = None
            return Line(f"{held.text}; recovered {took:.2f} s after {held.what}", True)
        if now - held.formed_at >= STEP_WAIT_S:
            why = f"no training step reported in {STEP_WAIT_S:g} s"
        elif view.phase in ("SUCCEEDED", "FAILED"):   # no later answer will say more: said now, as formed
            why = "the job ended before every member reported a training step in it"
        else:
            return None
        self.recoveries.append(held.formed_at - held.since)
        self._held = None
        return Line(f"{held.formed_line()}; {why}", True)

    def _waiting(self, view: JobStatusInfo, now: float) -> Optional[Line]:
        """Every WAIT_LINE_EVERY_S while the job has fewer workers than min-np (before its first
        world or after): how many it waits for, so a late host is not a silent wait."""
        joined = sum(1 for m in view.members if m.attached)
        if view.phase not in ("FORMING", "WAITING") or joined >= view.min_np:
            self._waiting_since = None
            return None
        if self._waiting_since is None:
            self._waiting_since = self._waiting_told = now
            return None
        if now - self._waiting_told < WAIT_LINE_EVERY_S:
            return None
        self._waiting_told = now
        missing = view.min_np - joined
        return Line(f"waiting for {missing} more worker{'s' if missing > 1 else ''}: {joined} of min-np {view.min_np} "
                    f"joined, {now - self._waiting_since:.0f} s (the job fails after {view.elastic_timeout_s:g} s "
                    "below min-np)")
