"""Each job's timer: one task that fires what time alone changes, then forgets the job once it is over.

While the job runs it wakes at the earliest of: the decision's next deadline (a settle window, the
elastic timeout, a blacklisting's end), a worker's reattach deadline (it must open its Watch within
the heartbeat timeout of joining, or of a leader change), and the idle deadline of a job that has no
world and no open Watch (dropped, so joins that never watch hold no place under the job cap). A
finished job is kept for `finished_job_retention_s` (for Status, and to refuse late joiners), then
removed.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from . import decision as d
from .job_record import Job

if TYPE_CHECKING:
    from .server import RendezvousService


def start(job: Job, service: "RendezvousService") -> None:
    job.timer = asyncio.get_running_loop().create_task(_run(job, service))


async def _run(job: Job, service: "RendezvousService") -> None:
    config, decision = service.config, service.journal.config
    while job.state.phase not in d.TERMINAL:
        deadlines = [t for t in [d.next_deadline(job.state, decision), job.idle_deadline,
                                 *(t for t, _ in job.attach_deadline.values())] if t is not None]
        timeout = max(0.0, min(deadlines) - time.time()) if deadlines else None
        try:
            await asyncio.wait_for(job.wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        job.wake.clear()
        now = time.time()
        for w, (t, what) in list(job.attach_deadline.items()):
            if t <= now:
                del job.attach_deadline[w]
                if w not in job.streams and service.is_leader:
                    # The server's own doing (failover, restart) as much as the worker's:
                    # not counted against the host.
                    service.evict(job, w, what, count_failure=False, cause=d.Departure.NO_WATCH)
        if job.idle_deadline is not None and job.idle_deadline <= now:
            if job.streams or job.state.phase is not d.Phase.FORMING:
                job.idle_deadline = None
            elif service.is_leader:
                if await service.retire(job, f"dropped: no world and no worker watching it for "
                                             f"{config.heartbeat_timeout_s:g} s"):
                    return
                job.idle_deadline = time.time() + config.heartbeat_timeout_s  # retry
        due = d.next_deadline(job.state, decision)
        if due is not None and due <= now:
            service.journal.apply(job, d.Tick())
    finished_at = job.state.finished_at if job.state.finished_at is not None else time.time()
    await asyncio.sleep(max(0.0, finished_at + config.finished_job_retention_s - time.time()))
    await service.retire(job, f"finished {config.finished_job_retention_s:.0f} s ago, forgotten")
