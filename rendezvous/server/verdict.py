"""The judgement of a failure report: a pure function `judge_report(state, stream, report, heard, inquiry, now)`.

A peer's ReportFailure is evidence, not a verdict. It either says the suspect failed (lost,
silent, slow: a failure report) or accuses it (`Blame`: its address is unusable or what it sent
cannot be received, its row of a commit's membership check was impossible, it claimed a change or
a leave that did not happen, it diverged from the majority). One member's word evicts nobody
alive but itself: an accusation needs a majority, or (a dispute over one link) costs the accuser
its place too. The rules, in the order they apply:

* A report about another world than the current one is stale: it is dismissed.
* Only a member of the world may report; anyone else is refused.
* A suspect that is not a member of the world (any more), or the reporter itself, is not evicted.
* A claim of a pending change that the server did announce (for that world, or a newer world
  exists) is no false claim: dismissed. The server is the one source of membership truth.
* A suspect that went away meanwhile (evicted, left, joined again) needs nothing more: the report
  is answered as an eviction once what happened is stored.
* Corroborated: once more than half of the world's other members reported the same suspect for
  that version, one of them at least accusing it, it is evicted even while its stream is open (a
  probe answer would prove only that it lives). In a world of two the other member is that
  majority: nobody else can tell. A failure report counts towards the majority (a member that
  never connected to its successor is reported as silent by it and as unusable by its
  predecessor), an accusation is needed for it to evict a live suspect.
* A suspect without a stream that has not opened one since this replica began leading (a leader
  change or restart: no worker has its stream back yet) is given until the heartbeat timeout
  since leadership began to reattach. Its silence says nothing before that.
* A suspect without a stream is evicted. It counts against its host unless it never reattached
  after a leader change (the server's doing as much as the host's).
* An accusation no majority joins within twice the heartbeat timeout evicts nobody alone. A claim
  the server could not see (a false pending change or leave) is then dismissed: the accuser goes
  on training. What one link carried (Blame UNUSABLE: an address that leads nowhere, bytes that
  cannot be received) is seen by the link's two ends only. Bytes that cannot be received (Blame
  UNRECEIVABLE: more than a shift planned) no other member will ever see, so in a world of three
  or more, between two members that hold a link (ring neighbours, one host, neighbouring
  leaders), it is a dispute: nobody else can tell which of them is wrong and a ring cannot hold
  both, so both are evicted and the others go on. An address that leads nowhere (UNUSABLE) is
  seen by the other neighbour too, at its form timeout, so its report joins a later majority. Each may join again; neither counts against its host (a host is
  what a worker says it is); one accuser has one dispute, as it leaves with it. Any other leaves
  the accuser's ring broken, so the world is aborted and formed again.
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
from rendezvous.wire.membership import Blame

PROBE_SLACK_S = 0.25   # a probe's answer is awaited this much beyond the heartbeat timeout
# The other members' accusations are awaited this many heartbeat timeouts: they blamed the suspect
# at the same commit, so theirs are on the way, each after its own ring failed.
CORROBORATION_HEARTBEATS = 2.0
# Claims only the server can check: a false one harms nobody's ring, so no majority means dismiss.
_CLAIMS = (Blame.FALSE_PENDING, Blame.FALSE_LEAVE)


@dataclass(frozen=True)
class Report:
    """A ReportFailure, as plain values: `reporter` says `suspect` broke its ring of `world_version`."""

    reporter: str
    suspect: str
    world_version: int
    reason: str = ""                 # the reporter's words, as sent (escaped before they are shown)
    timed_out: bool = False          # the reporter's collective timed out waiting on the suspect
    blame: Blame = Blame.NONE        # what it accuses the suspect of (NONE: it reports a failure)


@dataclass(frozen=True)
class Heard:
    """What the members of the report's world said about its suspect for that version so far,
    this report included: who reported it, and what they accused it of (NONE: a failure)."""

    reports: tuple[tuple[str, Blame], ...] = ()   # (reporter, blame), one per reporter

    def reporters(self, suspect: str) -> set[str]:
        return {r for r, _ in self.reports if r != suspect}

    def blames(self) -> set[Blame]:
        return {b for _, b in self.reports if b is not Blame.NONE}


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
    reporter_seq: Optional[int] = None      # and the reporter's: a dispute needs the same reporter still there
    probe_deadline: Optional[float] = None  # once the suspect is probed: how long its answer counts
    corroboration_deadline: Optional[float] = None   # an accusation: how long the others' are awaited


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
class AwaitCorroboration:
    """Wait until another member reports the suspect, it goes away, or `until` passes; then ask again."""

    until: float


@dataclass(frozen=True)
class Evict:
    """Evict the suspect for `reason` (and the reporter with it: `reporter_too`); answer
    `evicted=True` once that is stored."""

    reason: str
    cause: d.Departure
    count_failure: bool
    detail: str
    reporter_too: bool = False       # a dispute only the two of them can see: the reporter goes too


@dataclass(frozen=True)
class Gone:
    """The suspect went away meanwhile: answer `evicted=True` once what happened is stored."""

    detail: str


@dataclass(frozen=True)
class RingBroken:
    """The suspect stays, the world is formed again (`reason` for the abort); the event log records
    the broken ring with its `cause` and `record_detail`; answer `evicted=False`."""

    reason: str
    cause: str                       # "broken_ring_link", "collective_timeout" or "uncorroborated_accusation"
    record_detail: str
    detail: str


Verdict = Union[Refuse, Dismiss, AwaitReattach, Probe, AwaitProbe, AwaitCorroboration, Evict, Gone, RingBroken]


def judge_report(state: d.JobState, stream: SuspectStream, report: Report, heard: Heard, inquiry: Inquiry,
                 now: float) -> tuple[Inquiry, Verdict]:
    """The verdict on `report` about `state`'s world at monotonic `now`, given what the world's
    members said about the suspect so far (`heard`), and the inquiry to ask with next."""
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
        if suspect == report.reporter:
            return inquiry, Dismiss("a worker does not report itself")
        if report.blame is Blame.FALSE_PENDING and announced_change(state, report.world_version):
            return inquiry, Dismiss(f"the server did announce a change of world {report.world_version}: "
                                    f"{suspect}'s claim was true")
        inquiry = replace(inquiry, suspect_seq=state.workers[suspect].join_seq,
                          reporter_seq=state.workers[report.reporter].join_seq)
    current = state.workers.get(suspect)
    if current is None or current.join_seq != inquiry.suspect_seq:
        probed = inquiry.probe_deadline is not None
        return inquiry, Gone("suspect's stream broke" if probed else "suspect gone meanwhile")
    why = f"reported by {report.reporter}: {shown(report.reason) or 'unreachable'}"
    if corroborated(state, suspect, heard):
        blames = heard.blames()
        cause = (d.Departure.DIVERGED if Blame.DIVERGED in blames else
                 d.Departure.UNUSABLE_ADDRESS if blames <= {Blame.UNUSABLE, Blame.UNRECEIVABLE} else d.Departure.BLAMED)
        accusers = sorted(heard.reporters(suspect))
        # The count first: the reporter's words may be cut short where the reason is shown.
        return inquiry, Evict(f"{_ACCUSED[cause]} (reported by {len(accusers)} of the {len(state.world) - 1} "
                              f"other member(s) of world {report.world_version}: {', '.join(accusers)}); {why}",
                              cause, True, f"suspect {_ACCUSED[cause]}, as a majority of its world reported")
    if report.blame is not Blame.NONE:
        return _accusation(state, stream, report, inquiry, now, why)
    if inquiry.probe_deadline is None:
        if not stream.open and stream.awaited and now < inquiry.reattach_until:
            return inquiry, AwaitReattach(inquiry.reattach_until)
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


_ACCUSED = {d.Departure.DIVERGED: "diverged from the majority",
            d.Departure.UNUSABLE_ADDRESS: "unusable ring address",
            d.Departure.BLAMED: "said what no worker says"}


def _accusation(state: d.JobState, stream: SuspectStream, report: Report, inquiry: Inquiry, now: float,
                why: str) -> tuple[Inquiry, Verdict]:
    """An accusation no majority made (yet)."""
    if not stream.open and stream.awaited and now < inquiry.reattach_until:
        return inquiry, AwaitReattach(inquiry.reattach_until)
    if not stream.open:
        return inquiry, Evict(f"no watch stream; {why}", d.Departure.REPORTED, not stream.awaited,
                              "suspect had no watch stream")
    if inquiry.corroboration_deadline is None:
        until = now + CORROBORATION_HEARTBEATS * inquiry.heartbeat_timeout_s + PROBE_SLACK_S
        return replace(inquiry, corroboration_deadline=until), AwaitCorroboration(until)
    if now < inquiry.corroboration_deadline:
        return inquiry, AwaitCorroboration(inquiry.corroboration_deadline)
    alone = (f"{report.suspect} was accused ({report.blame.value.lower()}) by {report.reporter} alone, no majority "
             f"of world {report.world_version}")
    if report.blame in _CLAIMS:
        return inquiry, Dismiss(f"{alone}: not evicted")
    # Bytes one link carried are seen by its receiver alone. (An address that leads nowhere is
    # seen by the other neighbour too, at its form timeout: its report joins a later majority.)
    if report.blame is Blame.UNRECEIVABLE and len(state.world) >= 3 and linked(state, report.reporter, report.suspect):
        reporter = state.workers.get(report.reporter)
        if reporter is None or reporter.join_seq != inquiry.reporter_seq or not state.in_world(report.reporter):
            return inquiry, Dismiss(f"{alone}: the accuser is gone (one dispute per accuser); not evicted")
        # Neither counts against its host: a host is what a worker says it is, and nothing tells
        # which of the two was wrong.
        return inquiry, Evict(f"{alone}, over their link only: a dispute nobody else can settle, both evicted; {why}",
                              d.Departure.DISPUTED, False, f"{alone}: both evicted (a dispute over their link)",
                              reporter_too=True)
    return inquiry, _ring_broken(state, report, why, f"{alone}: not evicted; world {report.world_version} "
                                                     f"re-formed")


def linked(state: d.JobState, a: str, b: str) -> bool:
    """Whether members `a` and `b` of `state`'s world hold a ring link: neighbours on the flat
    ring, ranks of one host (its local ring), or neighbouring hosts' leaders (the leaders' ring)."""
    ma, mb = state.member(a), state.member(b)
    if ma is None or mb is None:
        return False
    n = len(state.world)
    leaders = ma.local_rank == 0 == mb.local_rank and ma.cross_size > 1 \
        and (ma.cross_rank - mb.cross_rank) % ma.cross_size in (1, ma.cross_size - 1)
    return (ma.rank - mb.rank) % n in (1, n - 1) or ma.host == mb.host or leaders


def corroborated(state: d.JobState, suspect: str, heard: Heard) -> bool:
    """More than half of the world's members besides `suspect` reported it, and at least one accused it."""
    others = len(state.world) - (1 if state.in_world(suspect) else 0)
    return bool(heard.blames()) and others > 0 and 2 * len(heard.reporters(suspect)) > others


def announced_change(state: d.JobState, world_version: int) -> bool:
    """The server announced that world `world_version` ends: a change pending, an abort, or a newer world."""
    return (state.pending_version >= world_version or state.aborted_version >= world_version
            or state.world_version > world_version)


def _ring_broken(state: d.JobState, report: Report, why: str, detail: str) -> RingBroken:
    # Ids and a kind only in the event log: the reporter's own words stay in the abort notice.
    version, suspect = report.world_version, report.suspect
    member = state.member(suspect)
    who = f"rank {member.rank} ({suspect})" if member is not None else suspect
    if report.blame is not Blame.NONE:
        return RingBroken(f"ring of world {version} broken, every member alive ({why})", "uncorroborated_accusation",
                          f"{report.reporter} alone accused {who} ({report.blame.value.lower()}), every member alive",
                          detail)
    cause = "collective timeout" if report.timed_out else "broken ring link"
    return RingBroken(f"ring of world {version} broken, every member alive ({why})",
                      cause.replace(" ", "_"), f"{cause} waiting on {who}, every member alive", detail)
