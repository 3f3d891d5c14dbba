"""What the service alone puts on the wire: the status of a refused RPC, the Watch events of the
decision's actions, the snapshot a (re)opened Watch begins with, and a job as Status shows it.
A world's events are each member's view (world_views.py).

The shared forms (specs, members, the trailing metadata keys) are rendezvous/wire/messages.py's;
this module is the server's, so a worker never loads it (nor the decision it reads).
"""
from __future__ import annotations

from typing import Container, Mapping, Optional, Tuple, Union

import grpc

from rendezvous.server import decision as d
from rendezvous.wire.membership import StragglerReport
from rendezvous.server.world_views import WorldViews
from rendezvous.wire.messages import member_pb, pb, refusal_metadata, spec_pb, straggler_pb

# What the decision's refusal kinds are on the wire. The server picks the code from the kind,
# never from a reason's text.
REFUSAL_CODES = {
    d.Refusal.FINISHED: grpc.StatusCode.FAILED_PRECONDITION,
    d.Refusal.BLACKLISTED: grpc.StatusCode.FAILED_PRECONDITION,
    d.Refusal.WORKER_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    d.Refusal.NOT_MEMBER: grpc.StatusCode.PERMISSION_DENIED,
}
NO_WORLD_YET = "no world formed yet"   # standby_reason's before the job's first world


def standby_reason(state: d.JobState, worker_id: str, now: float) -> str:
    """Why a registered worker is not in the world, and what it waits for (its Standby notice)."""
    if not state.world:
        return NO_WORLD_YET
    worker = state.workers.get(worker_id)
    record = state.hosts.get(worker.host) if worker is not None else None
    if record is not None and record.blacklisted_until > now:
        return (f"host {worker.host} is blacklisted for {record.blacklisted_until - now:.0f} s more after "
                f"repeated failures or a straggler")
    if len(state.world) >= state.spec.max_np:
        return (f"beyond max_np={state.spec.max_np}: a hot spare, it takes the place of the next member that "
                f"fails or leaves")
    return (f"joins world {state.world_version + 1} at the next commit of world {state.world_version} "
            f"({len(state.world)} of max_np={state.spec.max_np} in it)")



class RpcRefusal(Exception):
    """Raised inside handlers: the RPC fails with `code` and `message`. `leader` (a follower's hint)
    and `finished` (True/False: refused because the job succeeded/failed) go in trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, *, leader: str = "",
                 finished: Optional[bool] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.leader = leader
        self.finished = finished

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return refusal_metadata(self.leader, self.finished)


def outcome(phase: d.Phase) -> Optional[bool]:
    """True/False for a job that succeeded/failed; None while it runs."""
    return {d.Phase.SUCCEEDED: True, d.Phase.FAILED: False}.get(phase)


def refusal(rejected: d.Rejected, message: str, phase: d.Phase) -> RpcRefusal:
    """The status of a join or success report the decision refused, in a job now in `phase`."""
    finished = outcome(phase) if rejected.kind is d.Refusal.FINISHED else None
    return RpcRefusal(REFUSAL_CODES[rejected.kind], message, finished=finished)


STATUS_PAGE = 4096   # members a Status answer lists per job at most (~150 B each)


def job_status(state: d.JobState, attached: Container[str], now: float,
               stragglers: Mapping[str, StragglerReport] = {},   # noqa: B006 (read only)
               progress: Mapping[str, Tuple[int, int]] = {},     # noqa: B006 (read only)
               members_from: int = 0, max_members: int = 0) -> pb.JobStatus:
    """One job as Status shows it: its world's members in rank order, with their straggler
    reports (`stragglers`, by worker id) and progress (`progress`: the newest world each stepped
    in, the training step its last commit holds), then the standby workers; of those, the page
    of at most `max_members` (0 or more than STATUS_PAGE: STATUS_PAGE) from `members_from` on."""
    js = pb.JobStatus(job_id=state.job_id, world_version=state.world_version, phase=state.phase.value,
                      reason=state.reason, spec=spec_pb(state.spec),
                      blacklisted_hosts=state.blacklisted_hosts(now))
    listed = [m for m in state.world if m.worker_id in state.workers]
    standby = state.standby()
    limit = min(max_members or STATUS_PAGE, STATUS_PAGE)
    js.members_from, js.members_total = members_from, len(listed) + len(standby)
    for m in listed[members_from:members_from + limit]:
        stepped, step = progress.get(m.worker_id, (0, -1))
        js.members.add(member=member_pb(m), in_world=True, attached=m.worker_id in attached,
                       age_s=now - state.workers[m.worker_id].joined_at,
                       straggler=straggler_pb(stragglers.get(m.worker_id)), stepped_world=stepped, step=step)
    first = max(0, members_from - len(listed))
    for wid in list(standby)[first:first + limit - len(js.members)]:
        w = state.workers[wid]
        js.members.add(member=pb.Member(worker_id=wid, host=w.host, ring_address=w.ring_address,
                                        commit_step=w.commit_step),
                       in_world=False, attached=wid in attached, age_s=now - w.joined_at)
    return js


def job_event_pb(e) -> pb.JobEvent:
    """A history.RecentEvent as Status carries it."""
    return pb.JobEvent(time=e.time, event=e.event, world_version=e.world_version,
                       worker_id=e.worker_id, detail=e.detail, numbers=e.numbers)


# --------------------------------------------------------------------------------- events
def standby_event(world_version: int, reason: str) -> pb.WatchEvent:
    return pb.WatchEvent(standby=pb.Standby(world_version=world_version, reason=reason))


def notice_event(action: Union[d.AnnouncePending, d.AnnounceAbort]) -> pb.WatchEvent:
    """What the members of the world before the change are told: pending change, or abort."""
    if isinstance(action, d.AnnouncePending):
        return pb.WatchEvent(pending=pb.MembershipPending(world_version=action.world_version,
                                                          reason=action.reason))
    return pb.WatchEvent(abort=pb.AbortVersion(world_version=action.world_version, reason=action.reason,
                                               acknowledge=action.acknowledge))


def finished_event(succeeded: bool, reason: str) -> pb.WatchEvent:
    return pb.WatchEvent(finished=pb.JobOutcome(succeeded=succeeded, reason=reason))


def snapshot(state: d.JobState, views: WorldViews, worker_id: str, now: float) -> list[pb.WatchEvent]:
    """What a worker opening (or reopening) its Watch is sent first, from the stored `state` (whose
    world `views` are): how the job ended; or its world, followed by the abort if that world was
    aborted; or a Standby notice."""
    if state.phase in d.TERMINAL:
        return [finished_event(state.phase is d.Phase.SUCCEEDED, state.reason)]
    member = views.member(worker_id)
    if member is None:
        return [standby_event(state.world_version, standby_reason(state, worker_id, now))]
    events = [views.event(member)]
    if state.aborted_version == state.world_version:
        events.append(pb.WatchEvent(abort=pb.AbortVersion(
            world_version=state.world_version, reason="a member of this world failed",
            acknowledge=d.abort_acks_wanted(len(state.world)))))
    return events
