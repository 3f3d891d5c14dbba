"""A job's liveness clocks, with one owner: by when each worker must open its Watch, when a job that
nobody watches is dropped, and since when a failure has been waiting for the next world.

* A worker must open its Watch within the heartbeat timeout of joining; after a leader change (or
  a restart) every registered worker gets the reattach window to open it again. Missing it evicts
  the worker (job_timer.py), and not against its host: the server's doing as much as the host's.
* A job that has no world yet and no open Watch is dropped after the heartbeat timeout, so joins
  that never watch hold no place under the job cap; any stream opening, or a world, keeps it.
* The recovery clock starts at the first failure signal of a member of the world (a broken
  stream, an eviction, a broken ring) and stops at the next world announced: the
  elastic_rendezvous_failure_to_world_seconds histogram measures that span.

The Watch and idle deadlines are wall-clock seconds (they are compared with the decision's, which
are); the recovery clock is monotonic. The Watch deadlines are also kept in a heap, so that the
job's timer, which looks at them after every event, costs O(log workers) there, not O(workers). Every method takes the time it acts at, so the rules are
table-tested without clocks (tests/rendezvous/test_liveness.py).
"""
from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field
from typing import Iterable, Optional

from rendezvous.server import decision as d


class Idle(enum.Enum):
    """What the idle clock says about a job at some instant."""

    NOT_DUE = "not_due"    # no idle deadline, or not reached
    KEPT = "kept"          # reached, but the job has a stream or a world: the clock is stopped
    DROP = "drop"          # reached with no world and no stream: drop the job


@dataclass
class Liveness:
    heartbeat_timeout_s: float
    # worker id -> (wall time by which it must open its Watch, why it is evicted if it has not)
    watch_by: dict[str, tuple[float, str]] = field(default_factory=dict)
    idle_at: Optional[float] = None        # wall time the job is dropped at if nobody watches it
    # (deadline, worker id) of every deadline set; an entry watch_by no longer holds is stale
    _due: list = field(default_factory=list)
    failure_at: Optional[float] = None     # monotonic: the first failure since the last world

    @classmethod
    def of_new_job(cls, heartbeat_timeout_s: float, now: float) -> "Liveness":
        """A job just created: nobody watches it yet."""
        return cls(heartbeat_timeout_s, idle_at=now + heartbeat_timeout_s)

    @classmethod
    def after_leader_change(cls, heartbeat_timeout_s: float, workers: Iterable[str], now: float,
                            window_s: float) -> "Liveness":
        """A running job this replica just loaded as the new leader: nobody has a stream here yet,
        so every registered worker has the reattach window `window_s` to open one."""
        why = f"did not reattach within {window_s:g} s of a leader change"
        until = now + window_s
        live = cls(heartbeat_timeout_s, watch_by={w: (until, why) for w in workers}, idle_at=until)
        live._due = [(until, w) for w in live.watch_by]   # one deadline: already a heap
        return live

    # ------------------------------------------------------------------------- Watch deadlines
    def joined(self, worker_id: str, now: float) -> None:
        """`worker_id` joined (again): it must open its Watch within the heartbeat timeout. (A stale
        deadline of an earlier session is replaced; one left after a drop finds nobody to evict.)"""
        until = now + self.heartbeat_timeout_s
        self.watch_by[worker_id] = (until, f"did not open its watch stream within "
                                           f"{self.heartbeat_timeout_s:g} s of joining")
        heapq.heappush(self._due, (until, worker_id))
        if len(self._due) > 2 * len(self.watch_by) + 64:   # mostly stale: rebuild
            self._due = [(t, w) for w, (t, _) in self.watch_by.items()]
            heapq.heapify(self._due)

    def watch_opened(self, worker_id: str) -> None:
        """`worker_id` opened its Watch: its deadline is met, and the job is watched."""
        self.watch_by.pop(worker_id, None)
        self.idle_at = None

    def awaits_watch(self, worker_id: str) -> bool:
        """Whether `worker_id` has not opened its Watch since it joined or since this replica leads."""
        return worker_id in self.watch_by

    def missed_watches(self, now: float) -> list[tuple[str, str]]:
        """(worker id, why) of every deadline passed at `now`, forgotten as they are returned."""
        missed = []
        while self._first_due() is not None and self._due[0][0] <= now:
            _, w = heapq.heappop(self._due)
            missed.append((w, self.watch_by.pop(w)[1]))
        return missed

    def _first_due(self) -> Optional[float]:
        """The earliest Watch deadline still set (stale heap entries dropped on the way)."""
        while self._due:
            t, w = self._due[0]
            current = self.watch_by.get(w)
            if current is not None and current[0] == t:
                return t
            heapq.heappop(self._due)
        return None

    # ------------------------------------------------------------------------------ idle clock
    def streams_gone(self, now: float) -> bool:
        """The job's last open stream closed: start the idle clock unless it runs. True if it
        started (a timer waiting for the old deadline must wake up)."""
        if self.idle_at is not None:
            return False
        self.idle_at = now + self.heartbeat_timeout_s
        return True

    def idle(self, now: float, *, watched: bool, forming: bool) -> Idle:
        """The idle verdict at `now` for a job that has open streams (`watched`) or not, and no
        world yet (`forming`) or one. A kept job's clock stops until its streams are gone again."""
        if self.idle_at is None or self.idle_at > now:
            return Idle.NOT_DUE
        if watched or not forming:
            self.idle_at = None
            return Idle.KEPT
        return Idle.DROP

    def retry_drop(self, now: float) -> None:
        """Dropping the job failed (the store): try again a heartbeat timeout from `now`."""
        self.idle_at = now + self.heartbeat_timeout_s

    def next_deadline(self) -> Optional[float]:
        """The earliest wall time at which `missed_watches` or `idle` may have news; None: none."""
        first = self._first_due()
        times = [first] if first is not None else []
        if self.idle_at is not None:
            times.append(self.idle_at)
        return min(times) if times else None

    # -------------------------------------------------------------------------- recovery clock
    def failure_signal(self, now: float, state: d.JobState, worker_id: Optional[str] = None) -> None:
        """A failure in the job's world was noticed at monotonic `now` (of `worker_id`, if named):
        the recovery clock starts, once. A worker outside the world failing changes no world."""
        if self.failure_at is None and (worker_id is None or state.in_world(worker_id)):
            self.failure_at = now

    def world_announced(self, now: float) -> Optional[float]:
        """A world was announced at monotonic `now`: the seconds since the failure it recovers
        from (None: it recovers from none), and the clock stops."""
        started, self.failure_at = self.failure_at, None
        return None if started is None else now - started
