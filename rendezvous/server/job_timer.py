"""Each job's timer: one task that fires what time alone changes, then forgets the job once it is over.

While the job runs it wakes at the earliest of: the decision's next deadline (a settle window, the
elastic timeout, a blacklisting's end) and the job's liveness deadlines (liveness.py: a worker that
must open its Watch, a job nobody watches). A finished job is kept for `retention_s` (for Status,
and to refuse late joiners), then removed.

Like the journal, the timers are given plain functions, not the service: `is_leader()`,
`evict(job, worker_id, reason, count_failure=, cause=)`, `retire(job, why)` (remove the job; False
when the store failed) and `apply(job, event)` (decide, then store). The clock (wall time) is
passed in too, so `fire` is tested with fakes (tests/rendezvous/test_job_timer.py).
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from rendezvous.server import decision as d
from rendezvous.server.job_record import Job
from rendezvous.server.liveness import Idle


class JobTimers:
    def __init__(self, decision: d.DecisionConfig, *, retention_s: float,
                 is_leader: Callable[[], bool], evict: Callable[..., int],
                 retire: Callable[[Job, str], Awaitable[bool]],
                 apply: Callable[[Job, d.Event], object],
                 clock: Callable[[], float] = time.time):
        self.decision = decision
        self.retention_s = retention_s
        self._is_leader = is_leader
        self._evict = evict
        self._retire = retire
        self._apply = apply
        self._clock = clock

    def start(self, job: Job) -> None:
        job.timer = asyncio.get_running_loop().create_task(self._run(job))

    def next_deadline(self, job: Job) -> Optional[float]:
        """When the job's timer must wake next (wall time); None: only when something changes."""
        times = [t for t in (d.next_deadline(job.state, self.decision),
                             job.liveness.next_deadline()) if t is not None]
        return min(times) if times else None

    async def fire(self, job: Job, now: float) -> bool:
        """Do what is due at wall time `now`. True when the job was dropped (the timer ends)."""
        for worker_id, why in job.liveness.missed_watches(now):
            if worker_id not in job.streams and self._is_leader():
                # The server's own doing (failover, restart) as much as the worker's: not
                # counted against the host.
                self._evict(job, worker_id, why, count_failure=False, cause=d.Departure.NO_WATCH)
        idle = job.liveness.idle(now, watched=bool(job.streams),
                                 forming=job.state.phase is d.Phase.FORMING)
        if idle is Idle.DROP and self._is_leader():
            if await self._retire(job, f"dropped: no world and no worker watching it for "
                                       f"{job.liveness.heartbeat_timeout_s:g} s"):
                return True
            job.liveness.retry_drop(self._clock())
        due = d.next_deadline(job.state, self.decision)
        if due is not None and due <= now:
            self._apply(job, d.Tick())
        return False

    async def _run(self, job: Job) -> None:
        while job.state.phase not in d.TERMINAL:
            deadline = self.next_deadline(job)
            timeout = max(0.0, deadline - self._clock()) if deadline is not None else None
            try:
                await asyncio.wait_for(job.wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            job.wake.clear()
            if await self.fire(job, self._clock()):
                return
        finished_at = job.state.finished_at if job.state.finished_at is not None else self._clock()
        await asyncio.sleep(max(0.0, finished_at + self.retention_s - self._clock()))
        await self._retire(job, f"finished {self.retention_s:.0f} s ago, forgotten")
