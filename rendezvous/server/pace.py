"""What the leader knows of its workers' pace: the straggler reports their Heartbeats carry, and
who could take a straggler's place.

Each worker judges its own pace with the others of its world (elastic/runtime/straggler_detector.py) and reports
the verdict with its Heartbeat. The board keeps the latest report of each member of the current
world, in memory only: soft state like a heartbeat, which the next heartbeat after a failover or
a restart brings back; a report about another world than the current one is dropped. Status
shows the reports (`elastic-rendezvous status --watch`, the launchers), and the first report that
names a worker a straggler in a world is an event (`straggler_detected`).
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from rendezvous.server import decision as d
from rendezvous.wire.membership import StragglerReport

log = logging.getLogger("rendezvous.server.service")


class StragglerBoard:
    """The latest straggler report of each member of one job's current world."""

    def __init__(self) -> None:
        self._world_version = 0
        self._reports: dict[str, StragglerReport] = {}

    def heard(self, state: d.JobState, worker: d.Worker, report: StragglerReport, now: float, *,
              record: Callable[..., None]) -> int:
        """A Heartbeat carried `report`: noted (`record(state, "straggler_detected", ...)` when it
        names the worker a straggler for the first time in this world); returns the spares that
        could take its place, counted only for a worker that is slow at all (the count costs a
        pass over the job's workers)."""
        named = self.note(state, worker.worker_id, report)
        if named is not None:
            record(state, "straggler_detected", worker_id=worker.worker_id,
                   detail=f"{named['factor']:.2f}x the median compute for {named['windows']} windows", **named)
        return spares(state, worker.host, now) if report.slow_windows else 0

    def note(self, state: d.JobState, worker_id: str, report: StragglerReport) -> Optional[dict]:
        """Keeps `report` from `worker_id` if it is about the current world and the worker is a
        member of it; returns the fields of a `straggler_detected` event when it names the worker
        a straggler for the first time in this world (else None)."""
        member = state.member(worker_id)
        if report.world_version != state.world_version or member is None:
            return None
        if report.world_version != self._world_version:   # a new world: the last one's verdicts are over
            self._world_version, self._reports = report.world_version, {}
        before = self._reports.get(worker_id)
        self._reports[worker_id] = report
        if not report.named or (before is not None and before.named):
            return None
        log.warning("job %s: worker %s (rank %d, host %s) is a straggler in world %d: %.2fx the median compute "
                    "time for %d windows", state.job_id, worker_id, member.rank, member.host,
                    state.world_version, report.score, report.slow_windows)
        return {"rank": member.rank, "host": member.host, "factor": round(report.score, 3),
                "windows": report.slow_windows}

    def current(self, state: d.JobState) -> dict[str, StragglerReport]:
        """The reports of the current world's members (none from an earlier world)."""
        if self._world_version != state.world_version:
            return {}
        return {w: r for w, r in self._reports.items() if state.in_world(w)}


def spares(state: d.JobState, host: str, now: float) -> int:
    """Registered workers outside the world that could take the place of a worker of `host` that
    leaves: their Watch is open, and their host is neither `host` (a straggler's host cools
    down as it leaves) nor blacklisted."""
    in_world = state.world_ids()
    blocked = set(state.blacklisted_hosts(now)) | {host}
    return sum(1 for w in state.workers.values()
               if w.worker_id not in in_world and w.attached and w.host not in blocked)
