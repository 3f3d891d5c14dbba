"""The launcher's side of straggler detection: naming this host's workers that the rendezvous
shows as stragglers, and what becomes of the slot of one that left as a straggler.

The workers judge their pace among themselves (elastic/runtime/straggler_detector.py) and report it with their
progress reports (ReportProgress); the launcher learns it, as everything else about the job, from Status answers: the
server's ``straggler_detected`` event (once per worker and world, with its rank, factor and
windows as numbers), and its ``straggler_left`` event for a worker that left because it was one
(``--straggler-policy evict``). The events outlive the worker's membership: one that leaves
right after it was named is still named here. Nothing a worker prints decides anything.

A straggler's host enters the rendezvous blacklist cooldown as it leaves: the slow spot is the
host. Its slot is retired, never respawned: a launcher starts workers only on its own host, so a
respawn would go back into the same slow spot (a loop: evicted, respawned, slow again). Its place
is taken by a spare, a worker on standby on another host, which the rendezvous puts into the
next world by itself; with no spare, the worker left only if the job kept ``--min-np`` without it.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Dict, List, Optional, Set, Tuple

from rendezvous.client.status_client import JobStatusInfo

def host_cooling(view: Optional[JobStatusInfo], host: str) -> bool:
    """Whether the rendezvous has ``host`` in its blacklist cooldown (a worker started there now
    would be refused at its join)."""
    return view is not None and host in view.blacklisted_hosts


@dataclasses.dataclass(frozen=True)
class Named:
    """A local worker the rendezvous shows as a straggler, for the first time in a world."""

    line: str
    fields: Dict[str, object]   # the straggler_detected event's (its host is the launcher's: a local worker)


class StragglerWatch:
    """Follows Status answers for this host's stragglers (``policy``: the --straggler-policy
    the launcher gave its workers)."""

    def __init__(self, policy: str, host: str):
        self.policy, self.host = policy, host
        self._told: Set[Tuple[str, int]] = set()   # (worker id, world version) already named
        self._left: Set[str] = set()               # workers the server says left as stragglers

    def update(self, view: JobStatusInfo, local: Collection[str]) -> List[Named]:
        """The ``local`` workers this answer's events newly name stragglers (each once per world)."""
        self._left |= {e.worker_id for e in view.events if e.event == "straggler_left" and e.worker_id}
        named = []
        for e in view.events:
            told = (e.worker_id, e.world_version) in self._told
            if e.event != "straggler_detected" or e.worker_id not in local or told:
                continue
            self._told.add((e.worker_id, e.world_version))
            rank, factor, windows = (int(e.numbers.get("rank", -1)), e.numbers.get("factor", 0.0),
                                     int(e.numbers.get("windows", 0)))
            then = {"report": "it stays", "evict": "it leaves at its next commit unless the job would drop below "
                    "--min-np with no spare to take its place"}.get(self.policy, "")
            named.append(Named(
                f"worker {e.worker_id} (rank {rank}) on host {self.host} is a straggler: it computed "
                f"{factor:.2f}x the median of world {e.world_version} for {windows} commit windows in a "
                f"row (--straggler-policy {self.policy}" + (f": {then})" if then else ")"),
                {"worker_id": e.worker_id, "rank": rank, "factor": round(factor, 3), "windows": windows,
                 "policy": self.policy}))
        return named

    def left(self, worker_id: str, slot: int, view: Optional[JobStatusInfo]) -> Optional[str]:
        """None unless the rendezvous says ``worker_id`` (of ``slot``) left as a straggler (``view``:
        a fresh answer with recent events); else the launcher's line about it (the slot is retired)."""
        if view is not None:
            self.update(view, ())
        if worker_id not in self._left:
            return None
        return (f"left as a straggler (--straggler-policy evict); slot {slot} is retired, not respawned: host "
                f"{self.host} is the slow spot (it cools down in the rendezvous blacklist); a spare on another host, "
                f"if one stands by, takes the place")
