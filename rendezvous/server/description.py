"""What one decided action is, said once: `describe(action, world_version_before) -> Description`.

The server's log line, the event log and Status (history.py), the counters (server_metrics.py)
and the routing of the Watch events (who is sent what) all read the same description, so they
cannot disagree about what an action was, and a new kind of action is described in one place.
Pure: no clock, no I/O. Text a peer chose (a report's reason) is escaped for the event log and Status here.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from rendezvous.server import decision as d
from rendezvous.common.peer_text import shown


class Audience(enum.Enum):
    """Who hears of an action on their Watch stream."""

    NEW_WORLD = "new_world"        # each member its world, each other registered worker Standby
    WORLD_BEFORE = "world_before"  # the members of the world the decision started from
    DROPPED = "dropped"            # the worker whose session ended: its stream is closed
    EVERYONE = "everyone"          # every open stream, which then ends (the job is over)
    CALLER = "caller"              # nobody: the RPC that asked is refused with it


@dataclass(frozen=True)
class Description:
    summary: str                     # the server's log line, after "job <id>: "
    audience: Audience
    world_version: int               # a new world's own version; else the version it was decided in
    event: Optional[str] = None      # its event in the event log and Status; None: none of its own
    worker_id: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)   # the event line's fields
    detail: str = ""                 # Status's one line about it
    eviction: Optional[str] = None   # the evictions_total cause label, when a worker was evicted
    world_announced: bool = False    # a new world: counted, and the recovery clock stops


def describe(action: d.Action, world_version_before: int) -> Description:
    """The description of `action`, decided while the job's world had version `world_version_before`."""
    return _DESCRIBERS[type(action)](action, world_version_before)


def _world(a: d.AnnounceWorld, _: int) -> Description:
    members = [{"worker_id": m.worker_id, "rank": m.rank, "host": m.host} for m in a.members]
    counts = f"{len(a.members)} member(s), {len(a.standby)} standby"
    return Description(f"world {a.world_version} announced: {counts}", Audience.NEW_WORLD, a.world_version,
                       "world_formed", fields={"size": len(a.members), "members": members,
                                               "standby": len(a.standby)},
                       detail=counts, world_announced=True)


def _pending(a: d.AnnouncePending, world_version_before: int) -> Description:
    return Description(f"change pending for world {a.world_version}: {a.reason}", Audience.WORLD_BEFORE,
                       world_version_before)


def _abort(a: d.AnnounceAbort, world_version_before: int) -> Description:
    return Description(f"abort world {a.world_version}: {a.reason}", Audience.WORLD_BEFORE,
                       world_version_before)


def _dropped(a: d.Dropped, world_version_before: int) -> Description:
    summary = f"worker {a.worker_id} dropped: {a.reason}"
    reason = shown(a.reason)
    cause = a.cause.eviction
    if cause is None:   # a clean leave; a straggler's is an event of its own (its host cools down)
        event = "straggler_left" if a.cause is d.Departure.STRAGGLER else "worker_left"
        return Description(summary, Audience.DROPPED, world_version_before, event, a.worker_id,
                           {"reason": reason}, reason)
    return Description(summary, Audience.DROPPED, world_version_before, "worker_evicted", a.worker_id,
                       {"cause": cause, "reason": reason}, f"{cause}: {reason}", eviction=cause)


def _finished(a: d.AnnounceFinished, world_version_before: int) -> Description:
    outcome = "succeeded" if a.succeeded else "failed"
    reason = shown(a.reason)
    return Description(f"finished ({outcome}): {a.reason}", Audience.EVERYONE, world_version_before,
                       "job_finished", fields={"outcome": outcome, "reason": reason},
                       detail=f"{outcome}: {reason}")


def _rejected(a: d.Rejected, world_version_before: int) -> Description:
    return Description(f"worker {a.worker_id} refused: {a.reason}", Audience.CALLER, world_version_before)


_DESCRIBERS: dict[type, Callable[[Any, int], Description]] = {
    d.AnnounceWorld: _world,
    d.AnnouncePending: _pending,
    d.AnnounceAbort: _abort,
    d.Dropped: _dropped,
    d.AnnounceFinished: _finished,
    d.Rejected: _rejected,
}
