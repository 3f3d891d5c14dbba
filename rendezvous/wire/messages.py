"""The wire in Python, for both sides: the generated messages (`pb`) and stubs (`pb_grpc`) of
protos/rendezvous.proto, the protobuf forms of the values both sides share (membership.py), and the
trailing metadata of a refusal.

Nothing here reads a message's text: a refusal because the job is over carries
`elastic-job-outcome: succeeded|failed`, a follower's UNAVAILABLE the `leader` hint. What only the
server builds (its refusals, Watch events, Status answers) is server_wire.py's. Tools that speak the
wire directly (load generators, fuzzers, tests of the wire) import `pb` and `pb_grpc` from here.
"""
from __future__ import annotations

from typing import Optional

from rendezvous.wire._proto import rendezvous_pb2 as pb
from rendezvous.wire._proto import rendezvous_pb2_grpc as pb_grpc
from rendezvous.wire.membership import Blame, JobSpec, Member, StragglerReport

__all__ = ["pb", "pb_grpc", "LEADER_KEY", "JOB_OUTCOME_KEY", "refusal_metadata", "job_outcome",
           "leader_hint", "spec_pb", "spec_from_pb", "member_pb", "member_from_pb", "straggler_pb",
           "straggler_from_pb", "blame_pb", "blame_from_pb"]

LEADER_KEY = "leader"                  # UNAVAILABLE from a follower: HOST:PORT of the leader
JOB_OUTCOME_KEY = "elastic-job-outcome"  # a refusal because the job is over: how it ended
_OUTCOME_TEXT = {True: "succeeded", False: "failed"}
_OUTCOME_OF = {text: outcome for outcome, text in _OUTCOME_TEXT.items()}


def refusal_metadata(leader: str = "", finished: Optional[bool] = None) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of a refusal: the `leader` hint of a follower, and how the job ended
    (True/False: succeeded/failed) when it was refused because the job is over."""
    md = []
    if leader:
        md.append((LEADER_KEY, leader))
    if finished is not None:
        md.append((JOB_OUTCOME_KEY, _OUTCOME_TEXT[finished]))
    return tuple(md)


def job_outcome(metadata) -> Optional[bool]:
    """From a failed call's trailing metadata: True/False when it was refused because the job
    succeeded/failed; None otherwise, and for a value this version does not know."""
    for key, value in metadata or ():
        if key == JOB_OUTCOME_KEY:
            return _OUTCOME_OF.get(value) if isinstance(value, str) else None
    return None


def leader_hint(metadata) -> str:
    """The `leader` a follower named in its trailing metadata ("" when none)."""
    value = dict(metadata or ()).get(LEADER_KEY, "")
    return value if isinstance(value, str) else ""


# --------------------------------------------------------------------------------- values
def spec_pb(spec: JobSpec) -> pb.JobSpec:
    return pb.JobSpec(min_np=spec.min_np, max_np=spec.max_np, elastic_timeout_s=spec.elastic_timeout_s)


def spec_from_pb(spec: pb.JobSpec) -> JobSpec:
    return JobSpec(spec.min_np, spec.max_np, spec.elastic_timeout_s)


def member_pb(m: Member) -> pb.Member:
    return pb.Member(worker_id=m.worker_id, host=m.host, ring_address=m.ring_address, rank=m.rank,
                     local_rank=m.local_rank, local_size=m.local_size, cross_rank=m.cross_rank,
                     cross_size=m.cross_size, commit_step=m.commit_step)


def member_from_pb(m: pb.Member) -> Member:
    return Member(m.worker_id, m.host, m.ring_address, m.rank, m.local_rank, m.local_size,
                  m.cross_rank, m.cross_size, m.commit_step)


def straggler_pb(r: Optional[StragglerReport]) -> Optional[pb.StragglerReport]:
    if r is None:
        return None
    return pb.StragglerReport(world_version=r.world_version, score=r.score, slow_windows=r.slow_windows,
                              named=r.named)


def straggler_from_pb(r: pb.StragglerReport) -> StragglerReport:
    return StragglerReport(r.world_version, r.score, r.slow_windows, r.named)


def blame_pb(blame: Blame) -> int:
    return pb.ReportFailureRequest.Blame.Value(blame.value)


def blame_from_pb(value: int, unusable_address: bool = False) -> Blame:
    """The accusation a report makes; a number this version does not know accuses of nothing
    (it is then judged as a failure report). The older `unusable_address` flag is UNUSABLE."""
    try:
        blame = Blame(pb.ReportFailureRequest.Blame.Name(value))
    except ValueError:
        blame = Blame.NONE
    return Blame.UNUSABLE if blame is Blame.NONE and unusable_address else blame
