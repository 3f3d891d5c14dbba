"""The judgement of a failure report: a pure function `judge_report(state, stream, report, inquiry, now)`.

A peer's ReportFailure is evidence, not a verdict. The rules, in the order they apply:

* A report about another world than the current one is stale: it is dismissed.
* Only a member of the world may report; anyone else is refused.
* A suspect that is not a member of the world (any more) is not evicted.
* A suspect without a stream that has not opened one since this replica began leading (a leader
  change or restart: no worker has its stream back yet) is given until the heartbeat timeout
  since leadership began to reattach. Its silence says nothing before that.
* A suspect that went away meanwhile (evicted, left, joined again) needs nothing more: the report
  is answered as an eviction once what happened is stored.
* An unusable ring address evicts the suspect even while its stream is open: a probe answer would
  prove only that it lives, and no ring of this job can include it.
* A suspect without a stream is evicted. It counts against its host unless it never reattached
  after a leader change (the server's doing as much as the host's).
* A suspect with a stream is probed, and its answer awaited for the heartbeat timeout. Losing its
  stream meanwhile evicts it. Answering, or keeping its connection alive to the end (keepalive is
  answered by gRPC's C core even while training code holds the GIL), keeps it: nobody is evicted,
  but the reporter's ring is broken, so the world is aborted and formed again.

No clocks, futures or protobuf here: the service gathers the facts (service-side plumbing in
probes.py), asks for a verdict, carries it out, and asks again after every wait. Tested as a table
(tests/rendezvous/test_verdict.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from rendezvous.common.peer_text import shown
from rendezvous.server import decision as d

PROBE_SLACK_S = 0.25   # a probe's answer is awaited this much beyond the heartbeat timeout


@dataclass(frozen=True)
class Report:
    """A ReportFailure, as plain values: `reporter` says `suspect` broke its ring of `world_version`."""

    reporter: str
    suspect: str
    world_version: int
    reason: str = ""                 # the reporter's words, as sent (escaped before they are shown)
    unusable_address: bool = False   # the suspect's ring address leads to no member of the job
    timed_out: bool = False          # the reporter's collective timed out waiting on the suspect


@dataclass(frozen=True)
class SuspectStream:
    """What this replica sees of the suspect's Watch stream when it asks for a verdict."""

    open: bool                       # the suspect has an open Watch stream here
    awaited: bool = False            # it has not opened one since it joined or this replica leads
    probe_answered: bool = False     # it answered the probe of this report


@dataclass(frozen=True)
class Inquiry:
    """One report being judged: its deadlines, fixed when it arrives, and how far it got (the judge's
    only memory between verdicts). Times are monotonic seconds."""

    reattach_until: float            # when leadership began + the heartbeat timeout
    heartbeat_timeout_s: float
    suspect_seq: Optional[int] = None       # the suspect's join_seq once the report is admitted
    probe_deadline: Optional[float] = None  # once the suspect is probed: how long its answer counts


# ---------------------------------------------------------------------------------------- verdicts
@dataclass(frozen=True)
class Refuse:
    """The reporter may not report on this world: the RPC fails (PERMISSION_DENIED)."""

    detail: str


@dataclass(frozen=True)
class Dismiss:
    """Nothing to do: answer `evicted=False`."""

    detail: str


@dataclass(frozen=True)
class AwaitReattach:
    """Wait until the suspect opens its stream, goes away, or `until` passes; then ask again."""

    until: float


@dataclass(frozen=True)
class Probe:
    """Send the suspect a probe; then ask again."""

    deadline: float


@dataclass(frozen=True)
class AwaitProbe:
    """Wait until the probe is answered, the suspect's stream ends, or `until` passes; then ask again."""

    until: float


@dataclass(frozen=True)
class Evict:
    """Evict the suspect for `reason`; answer `evicted=True` once that is stored."""

    reason: str
    cause: d.Departure
    count_failure: bool
    detail: str


@dataclass(frozen=True)
class Gone:
    """The suspect went away meanwhile: answer `evicted=True` once what happened is stored."""

    detail: str


@dataclass(frozen=True)
class RingBroken:
    """The suspect stays, the world is formed again (`reason` for the abort); the event log records
    the broken ring with its `cause` and `record_detail`; answer `evicted=False`."""

    reason: str
    cause: str                       # "broken_ring_link" or "collective_timeout": a kind, not text
    record_detail: str
    detail: str


Verdict = Union[Refuse, Dismiss, AwaitReattach, Probe, AwaitProbe, Evict, Gone, RingBroken]


def judge_report(state: d.JobState, stream: SuspectStream, report: Report, inquiry: Inquiry,
                 now: float) -> tuple[Inquiry, Verdict]:
    """The verdict on `report` about `state`'s world at monotonic `now`, and the inquiry to ask with next."""
    version, suspect = state.world_version, report.suspect
    if inquiry.suspect_seq is None:   # the report has just arrived
        if report.world_version != version:
            return inquiry, Dismiss(f"stale report: world {report.world_version} is not the current "
                                    f"world {version}")
        if not state.in_world(report.reporter):
            return inquiry, Refuse(f"job {state.job_id}: worker {report.reporter} is not a member of "
                                   f"world {version}; only its members report its failures")
        if suspect not in state.workers or not state.in_world(suspect):
            return inquiry, Dismiss(f"{suspect} is not a member of world {version} (already evicted "
                                    f"or left)")
        inquiry = replace(inquiry, suspect_seq=state.workers[suspect].join_seq)
    current = state.workers.get(suspect)
    if current is None or current.join_seq != inquiry.suspect_seq:
        probed = inquiry.probe_deadline is not None
        return inquiry, Gone("suspect's stream broke" if probed else "suspect gone meanwhile")
    why = f"reported by {report.reporter}: {shown(report.reason) or 'unreachable'}"
    if inquiry.probe_deadline is None:
        if not stream.open and stream.awaited and now < inquiry.reattach_until:
            return inquiry, AwaitReattach(inquiry.reattach_until)
        if report.unusable_address:
            return inquiry, Evict(f"unusable ring address; {why}", d.Departure.UNUSABLE_ADDRESS, True,
                                  "suspect's ring address is unusable")
        if not stream.open:
            return inquiry, Evict(f"no watch stream; {why}", d.Departure.REPORTED, not stream.awaited,
                                  "suspect had no watch stream")
        deadline = now + inquiry.heartbeat_timeout_s + PROBE_SLACK_S
        return replace(inquiry, probe_deadline=deadline), Probe(deadline)
    if not stream.open:
        return inquiry, Evict(f"no watch stream; {why}", d.Departure.REPORTED, True,
                              "suspect lost its stream")
    if stream.probe_answered:
        return inquiry, _ring_broken(state, report, why, f"{suspect} answered a probe; world "
                                                         f"{report.world_version} re-formed")
    if now >= inquiry.probe_deadline:
        return inquiry, _ring_broken(state, report, why,
                                     f"{suspect} did not answer the probe but its connection stayed "
                                     f"alive (keepalive) for {inquiry.heartbeat_timeout_s:g} s; world "
                                     f"{report.world_version} re-formed")
    return inquiry, AwaitProbe(inquiry.probe_deadline)


def _ring_broken(state: d.JobState, report: Report, why: str, detail: str) -> RingBroken:
    # Ids and a kind only in the event log: the reporter's own words stay in the abort notice.
    version, suspect = report.world_version, report.suspect
    member = state.member(suspect)
    who = f"rank {member.rank} ({suspect})" if member is not None else suspect
    cause = "collective timeout" if report.timed_out else "broken ring link"
    return RingBroken(f"ring of world {version} broken, every member alive ({why})",
                      cause.replace(" ", "_"), f"{cause} waiting on {who}, every member alive", detail)
