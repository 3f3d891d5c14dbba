"""The membership decision of one job: a pure function `decide(state, event, now) -> (state, actions)`.

No sockets, threads, clocks or I/O here: the server feeds events (joins, leaves, evictions, ticks) with
the wall-clock time and carries out the actions returned (persist, then announce). Every rule is a table
test (tests/rendezvous/test_decision.py); the state round-trips through etcd as JSON (job_json.py), so
a restarted server or another replica continues exactly where the last one stopped.

Rules:
* A world forms once at least `min_np` workers are registered and no change arrived for `settle_s`
  (simultaneous changes become one new world; `settle_max_s` bounds the wait under a steady trickle).
* After an abort, the next world forms as soon as every member still registered has acknowledged the
  abort (AbortAck), without waiting out the settle window: a member that died with the first one
  never acknowledges, so it is evicted (or the window ends) before the world forms, and workers
  killed together still cost one re-form.
* At most `max_np` workers are in the world; the rest are hot spares that fill a failed member's place in
  the next world without waiting for a new join.
* Stable ranks: survivors keep their relative order, newcomers are appended, the member with the highest
  commit step becomes rank 0, and the ranks of one host are contiguous.
* A failure (eviction) aborts the current version at once; a clean join/leave only announces that a
  change is pending, so workers can switch at a commit boundary.
* Hosts failing `blacklist_after` times are refused for a cooldown that doubles on each blacklisting,
  capped at `cooldown_max_s` (like horovodrun's --blacklist-cooldown-range). A worker already waiting
  on such a host is promoted when the cooldown ends (the deadline includes the expiry).
* A straggler's leave (`Leave.straggler`, clean) puts its host in that cooldown at once: the host
  is slow, nothing of it should take the straggler's place (`blacklist_after` 0: never).
* Only eligible workers count towards `min_np` and enter a new world: survivors of the current world,
  and newcomers that opened their Watch stream (`attached`) on a host that is not blacklisted.
* Below `min_np` the job waits up to its elastic timeout, then fails with a reason.
* Evictions the server caused itself (a worker that did not reattach after a leader change) are not
  counted against the host: they say more about the control plane than about the host.
* A worker id belongs to its session: a join naming a registered worker must prove it is that
  worker (the hash of its current session matches); otherwise it is refused and the worker stays.
* Success is the world's, not one member's: the job completes when every registered member of the
  world the reports name (the current one, or the one before a switch never made) reported its
  function returned in it at one commit step. Until then a report changes nothing else (the early
  worker leaves on its own); only a member of the world its report names may report.

The job's credential (a hash of the token that created it), its ring secret and each worker's
session hash ride along in the state, so every replica and every restart sees the same ones; the
decision only compares them, it never makes them (no randomness in here).
"""
from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

from rendezvous.server.derived import DERIVED, ack_counts, carry, eligible_count, replace, updated, without
# The values both sides share (a worker asks with a JobSpec and receives Members) live in
# membership.py, so that a worker loads none of the decision; they are the decision's too.
from rendezvous.wire.membership import DEFAULT_MAX_NP, JobSpec, Member  # noqa: F401


@dataclass(frozen=True)
class SpecConflict:
    """A join named limits other than the running job's: it is refused, the job unchanged."""

    reason: str


def join_spec(job_id: str, asked: JobSpec, if_new: JobSpec,
              job: Optional[JobSpec]) -> Union[JobSpec, SpecConflict]:
    """The limits a join gets: the running job's `job` (None: this join creates the job).

    A limit the join leaves 0 says "none of my own: the job's", whenever the join comes. Into a
    running job it takes the job's; creating the job it takes `if_new`'s (what its launcher
    would have asked for alone, e.g. --min-np = --np), and where that is 0 too, the server's
    default (`JobSpec.resolved`). A limit the join names must be the running job's: the first
    join fixed them, and a join that disagrees is refused instead of changing the job.
    """
    if job is None:
        return JobSpec(asked.min_np or if_new.min_np, asked.max_np or if_new.max_np,
                       asked.elastic_timeout_s or if_new.elastic_timeout_s)
    if (asked.min_np and asked.min_np != job.min_np) or (asked.max_np and asked.max_np != job.max_np):
        wanted = ", ".join(f"{name}={value}" for name, value in
                           (("min_np", asked.min_np), ("max_np", asked.max_np)) if value)
        return SpecConflict(f"job {job_id} has min_np={job.min_np} max_np={job.max_np}; this join asks "
                            f"for {wanted} (leave a limit unset to take the job's)")
    return job


@dataclass(frozen=True)
class DecisionConfig:
    """Server-wide knobs of the decision: derived from rendezvous.server.server_config.ServerConfig (`decision()`),
    which is where their defaults are."""

    settle_s: float
    settle_max_s: float
    blacklist_after: int
    cooldown_min_s: float
    cooldown_max_s: float


class Phase(str, enum.Enum):
    FORMING = "FORMING"      # no world yet
    RUNNING = "RUNNING"      # a world is announced
    WAITING = "WAITING"      # below min_np after a world existed
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)


@dataclass(frozen=True)
class Worker:
    """A registered, live worker (in the world or standby)."""

    worker_id: str
    host: str
    ring_address: str
    commit_step: int
    join_seq: int
    joined_at: float
    attached: bool = True      # opened its Watch stream at least once (only then can it enter a world)
    session_hash: str = ""     # SHA-256 (hex) of its session secret; "" matches no session
    member_since: int = 0      # the first world version it was a member of (0: none yet)
    returned_in: int = 0       # the world version in which it reported its function returned (0: never)
    returned_step: int = -1    # and the commit step it returned at


@dataclass(frozen=True)
class HostRecord:
    failures: int = 0          # failures since the last blacklisting
    blacklistings: int = 0     # how often this host was blacklisted (drives the exponential cooldown)
    blacklisted_until: float = 0.0


@dataclass(frozen=True)
class JobState:
    job_id: str
    spec: JobSpec
    created_at: float
    phase: Phase = Phase.FORMING
    world_version: int = 0
    world: tuple[Member, ...] = ()
    aborted_version: int = 0                 # last version an abort was announced for
    pending_version: int = 0                 # last version a pending change was announced for (once
                                             # per version is enough)
    abort_acks: tuple[str, ...] = ()         # members that acknowledged the abort of `aborted_version`
    workers: Mapping[str, Worker] = field(default_factory=dict)
    hosts: Mapping[str, HostRecord] = field(default_factory=dict)
    change_first: Optional[float] = None     # first unapplied change (settle window opened)
    change_last: Optional[float] = None      # latest unapplied change
    below_min_since: Optional[float] = None
    next_seq: int = 0
    reason: str = ""
    finished_at: Optional[float] = None      # when the job reached SUCCEEDED/FAILED
    credential: str = ""                     # SHA-256 (hex) of the creating token; "": none (--insecure)
    ring_secret: str = ""                    # hex; handed to accepted joiners, never derived
    run: str = ""                            # random tag of this run of the job id (in session ids):
                                             # a session of an earlier run does not carry over

    def in_world(self, worker_id: str) -> bool:
        return worker_id in self._world_index()

    def member(self, worker_id: str) -> Optional[Member]:
        rank = self._world_index().get(worker_id)
        return None if rank is None else self.world[rank]

    def world_ids(self) -> set[str]:
        return set(self._world_index())

    def _world_index(self) -> Mapping[str, int]:
        """Rank by worker id of the world's members: built once per world (the states a decision
        derives share it, see derived.carry), so a membership question costs O(1), not O(N)."""
        cached = self.__dict__.get("_index")
        if cached is None or cached[0] is not self.world:
            cached = (self.world, {m.worker_id: i for i, m in enumerate(self.world)})
            object.__setattr__(self, "_index", cached)
        return cached[1]

    def standby(self) -> list[str]:
        in_world = self.world_ids()
        return sorted((w for w in self.workers if w not in in_world),
                      key=lambda w: self.workers[w].join_seq)

    def blacklisted_hosts(self, now: float) -> list[str]:
        return sorted(h for h, r in self.hosts.items() if r.blacklisted_until > now)


def new_job(job_id: str, spec: JobSpec, now: float, *, credential: str = "",
            ring_secret: str = "", run: str = "") -> JobState:
    if spec.min_np < 1 or spec.max_np < spec.min_np:
        raise ValueError(f"job {job_id}: need 1 <= min_np <= max_np, got min_np={spec.min_np} "
                         f"max_np={spec.max_np}")
    return JobState(job_id=job_id, spec=spec, created_at=now, below_min_since=now,
                    credential=credential, ring_secret=ring_secret, run=run)


# ----------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Join:
    worker_id: str
    host: str
    ring_address: str
    commit_step: int = -1
    attached: bool = True      # the server joins workers unattached and sends Attach on their Watch
    session_hash: str = ""     # hash of the session the server issues for this join
    proof: str = ""            # hash of the previous session the joiner presented ("" none)


@dataclass(frozen=True)
class Attach:
    """The worker opened its Watch stream: it can receive a world, so it may enter one."""

    worker_id: str


@dataclass(frozen=True)
class Leave:
    worker_id: str
    straggler: bool = False    # it leaves because it was named a straggler: its host cools down


class Departure(str, enum.Enum):
    """Why a worker's session ended, as a kind: metrics and event logs count by it, never by the
    reason's text."""

    LEFT = "LEFT"                          # Leave: a clean departure, not a failure
    STRAGGLER = "STRAGGLER"                # Leave of a straggler: clean too, and its host cools down
    STREAM_BROKEN = "STREAM_BROKEN"        # its Watch broke: crashed, or missed keepalive acks
    NO_WATCH = "NO_WATCH"                  # did not open (or, after a leader change, reopen) it
    REPORTED = "REPORTED"                  # a peer reported it and it had no stream
    UNUSABLE_ADDRESS = "UNUSABLE_ADDRESS"  # a majority found its ring address leads nowhere (or what it sent unusable)
    BLAMED = "BLAMED"                      # a majority found what it said impossible or false
    DIVERGED = "DIVERGED"                  # a majority found it ran other collectives or ring settings
    DISPUTED = "DISPUTED"                  # it and one other member accused across their link alone
    REJOINED = "REJOINED"                  # it joined again: the old session is replaced
    FAILED = "FAILED"                      # any other failure

    @property
    def eviction(self) -> Optional[str]:
        """The `cause` label of elastic_rendezvous_evictions_total (and of the event log's
        worker_evicted) a session that ended this way has; None: no eviction (a clean leave)."""
        return _EVICTION_LABELS[self]


# One table, so the documented list of causes, the event log and the tests cannot drift from it.
_EVICTION_LABELS: dict[Departure, Optional[str]] = {
    Departure.LEFT: None,
    Departure.STRAGGLER: None,                      # a clean leave
    Departure.STREAM_BROKEN: "stream_broken",       # crash (EOF/RST) or missed keepalive acks
    Departure.NO_WATCH: "no_watch",                 # never opened / reopened its Watch in time
    Departure.REPORTED: "report",                   # a peer's report, and it had no stream
    Departure.UNUSABLE_ADDRESS: "unusable_address",  # the majority's reports: its ring address is dead
    Departure.BLAMED: "blamed",                     # the majority's reports: it said impossible things
    Departure.DIVERGED: "diverged",                 # the majority's reports: it diverged from them
    Departure.DISPUTED: "dispute",                  # a link's two ends disagree; nobody else can tell
    Departure.REJOINED: "session_replaced",         # joined again: its old session ended
    Departure.FAILED: "other",
}


@dataclass(frozen=True)
class Evict:
    """The worker failed (stream broke, keepalive timeout, confirmed peer report)."""

    worker_id: str
    reason: str
    count_failure: bool = True   # False: the server caused it (no reattach after failover)
    cause: Departure = Departure.FAILED


@dataclass(frozen=True)
class RingBroken:
    """A member reports that the ring of `world_version` broke although its suspect is alive (a
    collective timed out on a slow peer, say). The world is unusable all the same: abort it
    and announce it again, so every member re-forms instead of waiting for an eviction."""

    reporter_id: str
    world_version: int
    reason: str


@dataclass(frozen=True)
class AbortAck:
    """A member received the abort of `world_version`: it is alive and waits for the next world."""

    worker_id: str
    world_version: int


@dataclass(frozen=True)
class Progress:
    worker_id: str
    commit_step: int


@dataclass(frozen=True)
class Success:
    worker_id: str
    world_version: int         # the world the reporter says it is a member of
    commit_step: int = 0       # the commit step at which its function returned


@dataclass(frozen=True)
class Tick:
    """Time passed; lets settle windows and elastic timeouts fire."""


Event = Union[Join, Attach, Leave, Evict, RingBroken, AbortAck, Progress, Success, Tick]


# ---------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class AnnounceWorld:
    """A new world: send it to its members, Standby to everyone else registered."""

    world_version: int
    members: tuple[Member, ...]
    standby: tuple[str, ...]


@dataclass(frozen=True)
class AnnouncePending:
    """Tell the members of `world_version` that a clean change will produce a new world."""

    world_version: int
    reason: str


@dataclass(frozen=True)
class AnnounceAbort:
    """A member of `world_version` failed: tell its survivors to abort what is in flight, and
    whether to acknowledge that (abort_acks_wanted)."""

    world_version: int
    reason: str
    acknowledge: bool = True


class Refusal(str, enum.Enum):
    """Why an event was refused: the server picks the status code from this, never from text."""

    FINISHED = "FINISHED"            # the job is over
    BLACKLISTED = "BLACKLISTED"      # the joiner's host is cooling down after repeated failures
    WORKER_EXISTS = "WORKER_EXISTS"  # the worker id is registered and the join did not prove it is it
    NOT_MEMBER = "NOT_MEMBER"        # a success report from outside the world it names


@dataclass(frozen=True)
class Rejected:
    """A join or a success report was refused; nothing changed and the RPC fails with `reason`."""

    worker_id: str
    reason: str
    kind: Refusal


@dataclass(frozen=True)
class Dropped:
    """A worker's old session ended (evicted, left, or replaced by a rejoin): close its stream."""

    worker_id: str
    reason: str
    cause: Departure = Departure.LEFT


@dataclass(frozen=True)
class AnnounceFinished:
    """The job is over: tell every attached worker how it ended, then end their streams."""

    succeeded: bool
    reason: str


Action = Union[AnnounceWorld, AnnouncePending, AnnounceAbort, Rejected, Dropped, AnnounceFinished]


# ---------------------------------------------------------------------------------------------- decide
def decide(state: JobState, event: Event, now: float,
           config: DecisionConfig) -> tuple[JobState, list[Action]]:
    """Apply one event at wall-clock time `now`; return the new state and what the server must do."""
    actions: list[Action] = []
    before = state
    if state.phase in TERMINAL:
        if isinstance(event, Join):
            actions.append(Rejected(event.worker_id, f"job {state.job_id} already finished "
                                                     f"({state.phase.value}: {state.reason})",
                                    Refusal.FINISHED))
        return state, actions

    if isinstance(event, Join):
        state = _on_join(state, event, now, config, actions)
    elif isinstance(event, Leave):
        leaver = state.workers.get(event.worker_id)
        state = _remove(state, event.worker_id, f"worker {event.worker_id} left"
                        + (" as a straggler" if event.straggler else ""), now, actions, failure=False,
                        config=config, cause=Departure.STRAGGLER if event.straggler else Departure.LEFT)
        if event.straggler and leaver is not None:
            state = _cool_down(state, leaver.host, now, config)
    elif isinstance(event, Evict):
        state = _remove(state, event.worker_id, event.reason, now, actions, failure=True,
                        config=config, count_failure=event.count_failure, cause=event.cause)
    elif isinstance(event, RingBroken):
        if event.world_version == state.world_version and state.in_world(event.reporter_id):
            state = _mark_change(_abort(state, event.reason, actions), now)
    elif isinstance(event, Attach):
        w = state.workers.get(event.worker_id)
        if w is not None and not w.attached:
            state = replace(state, workers=updated(state.workers, {w.worker_id: replace(w, attached=True)}))
            if not state.in_world(w.worker_id):
                state = _mark_change(state, now)
    elif isinstance(event, AbortAck):
        if (event.world_version == state.world_version == state.aborted_version
                and state.in_world(event.worker_id) and event.worker_id in state.workers
                and event.worker_id not in state.abort_acks):
            state = replace(state, abort_acks=state.abort_acks + (event.worker_id,))
    elif isinstance(event, Progress):
        w = state.workers.get(event.worker_id)
        if w is not None and event.commit_step > w.commit_step:
            state = replace(state, workers=updated(state.workers, {w.worker_id:
                                                                   replace(w, commit_step=event.commit_step)}))
    elif isinstance(event, Success):
        w = state.workers.get(event.worker_id)
        # Members stay in every world from their first one until they are removed, so "in the
        # current world, and a member since the version named" means a member of that world.
        if (w is None or not state.in_world(w.worker_id)
                or not 0 < w.member_since <= event.world_version <= state.world_version):
            actions.append(Rejected(event.worker_id, f"job {state.job_id}: worker {event.worker_id} "
                                                     f"is not a member of world {event.world_version} "
                                                     f"(current world {state.world_version}); only a member "
                                                     f"can end the job", Refusal.NOT_MEMBER))
            return state, actions
        w = replace(w, returned_in=event.world_version, returned_step=event.commit_step)
        state = replace(state, workers=updated(state.workers, {w.worker_id: w}))
        if not all_returned(state):
            return state, actions   # the others train on, or are about to return too
        members = sorted(m.worker_id for m in state.world if m.worker_id in state.workers)
        reason = (f"every member of world {state.world_version} returned at commit step {event.commit_step} "
                  f"({', '.join(members[:8])}{', ...' if len(members) > 8 else ''})")
        state = replace(state, phase=Phase.SUCCEEDED, reason=reason, change_first=None,
                        change_last=None, finished_at=now)
        actions.append(AnnounceFinished(True, reason))
        return state, actions
    elif not isinstance(event, Tick):
        raise TypeError(f"unknown event {event!r}")
    worker_id = getattr(event, "worker_id", None)
    if worker_id is not None and state is not before:
        state = carry(before, state, worker_id)
    result, actions = _evaluate(state, now, config, actions)
    for name in DERIVED:   # each records what it was derived from: a stale one is never used
        if name in state.__dict__ and name not in result.__dict__:
            object.__setattr__(result, name, state.__dict__[name])
    return result, actions


def next_deadline(state: JobState, config: DecisionConfig) -> Optional[float]:
    """When the server must send the next Tick (None: nothing time-driven is pending)."""
    if state.phase in TERMINAL:
        return None
    times = []
    # Below min_np the settle window cannot produce a world; only the elastic timeout matters.
    if state.change_last is not None and eligible_count(state) >= state.spec.min_np:
        times.append(min(state.change_last + config.settle_s, state.change_first + config.settle_max_s))
    if state.below_min_since is not None:
        times.append(state.below_min_since + state.spec.elastic_timeout_s)
    # A worker waiting on a blacklisted host becomes eligible when the cooldown ends. (Expired
    # records are reset by the next decide(), so no deadline here is ever left in the past.)
    blacklisted = {h: r.blacklisted_until for h, r in state.hosts.items() if r.blacklisted_until}
    if blacklisted:   # only the standby can wait on one (set difference in C: not one look per member)
        waiting = (state.workers[w] for w in state.workers.keys() - state._world_index().keys())
        times += [blacklisted[w.host] for w in waiting if w.host in blacklisted and w.attached]
    return min(times) if times else None


# Measured (bench/rendezvous_scale.py, with and without acknowledgements): they let a world of 64
# re-form in 0.03 s instead of 0.21, break even at 512 members, and make 4,096 re-form in 1.5 s
# instead of 0.55: each is a unary RPC to the leader, and N of them cost more than the window.
ABORT_ACKS_MAX_WORLD = 512


def abort_acks_wanted(world_size: int) -> bool:
    """Whether the members of an aborted world of `world_size` are asked to acknowledge the abort
    (so the next world need not wait out the settle window), or the window is cheaper."""
    return world_size <= ABORT_ACKS_MAX_WORLD


def _abort(state: JobState, reason: str, actions: list[Action]) -> JobState:
    """A member of the current world failed: its survivors are told once (abort_acks_wanted)."""
    if state.aborted_version == state.world_version:
        return state
    actions.append(AnnounceAbort(state.world_version, reason, abort_acks_wanted(len(state.world))))
    return replace(state, aborted_version=state.world_version)


def abort_acknowledged(state: JobState) -> bool:
    """The current world was aborted and every member of it still registered acknowledged that:
    nobody the next world could wait for is left, so it need not wait out the settle window."""
    if state.aborted_version != state.world_version or not state.world:
        return False
    alive, acked = ack_counts(state)
    return alive > 0 and acked == alive


def eligible(state: JobState, now: Optional[float] = None) -> list[str]:
    """Workers that may be in the next world, in order: survivors, then attached newcomers on hosts
    that are not blacklisted at `now` (None: by the records as they stand), by join order."""
    survivors = [m.worker_id for m in state.world if m.worker_id in state.workers]
    blocked = {h for h, r in state.hosts.items()
               if r.blacklisted_until and (now is None or r.blacklisted_until > now)}
    kept = set(survivors)
    newcomers = sorted((w for w in state.workers.values()
                        if w.worker_id not in kept and w.attached and w.host not in blocked),
                       key=lambda w: w.join_seq)
    return survivors + [w.worker_id for w in newcomers]


def _mark_change(state: JobState, now: float) -> JobState:
    return replace(state, change_first=state.change_first if state.change_first is not None else now,
                   change_last=now)


def _on_join(state: JobState, ev: Join, now: float, config: DecisionConfig,
             actions: list[Action]) -> JobState:
    rec = state.hosts.get(ev.host)
    if rec is not None and rec.blacklisted_until > now:
        actions.append(Rejected(ev.worker_id, f"host {ev.host} is blacklisted for "
                                              f"{rec.blacklisted_until - now:.1f} s more after "
                                              f"repeated failures or a straggler", Refusal.BLACKLISTED))
        return state
    existing = state.workers.get(ev.worker_id)
    if existing is not None:
        # Only the worker itself may replace its session: anyone else naming its id would end a
        # live member's session (and take its place in the ring).
        if not (ev.proof and existing.session_hash
                and hmac.compare_digest(ev.proof, existing.session_hash)):
            actions.append(Rejected(ev.worker_id, f"worker id {ev.worker_id} is taken in job "
                                                  f"{state.job_id}: joining again needs that worker's "
                                                  f"current session_id (or use another worker id)",
                                    Refusal.WORKER_EXISTS))
            return state
        # The worker joining again means its previous session is over (e.g. it saw its stream end):
        # end the old membership as a failure, since it vanished without leaving.
        state = _remove(state, ev.worker_id, f"worker {ev.worker_id} rejoined (previous session "
                                             f"replaced)", now, actions, failure=True,
                        config=config, count_failure=False, cause=Departure.REJOINED)
    worker = Worker(ev.worker_id, ev.host, ev.ring_address, ev.commit_step, state.next_seq, now,
                    attached=ev.attached, session_hash=ev.session_hash)
    state = replace(state, workers=updated(state.workers, {ev.worker_id: worker}),
                    next_seq=state.next_seq + 1)
    if state.world and len(state.world) < state.spec.max_np:
        state = _pending(state, f"worker {ev.worker_id} on {ev.host} joined", actions)
    return _mark_change(state, now)


def _reset_expired_blacklists(state: JobState, now: float) -> JobState:
    expired = {h: replace(r, blacklisted_until=0.0) for h, r in state.hosts.items()
               if r.blacklisted_until and r.blacklisted_until <= now}
    if not expired:
        return state
    state = replace(state, hosts={**state.hosts, **expired})
    # A worker waiting on one of these hosts may now fill a place in the world.
    in_world = state.world_ids()
    if any(w.host in expired and w.worker_id not in in_world for w in state.workers.values()):
        state = _mark_change(state, now)
    return state


def _pending(state: JobState, reason: str, actions: list[Action]) -> JobState:
    # One notice per version: a burst of joins must not cost O(joins x members) messages.
    if state.aborted_version == state.world_version or state.pending_version == state.world_version:
        return state
    actions.append(AnnouncePending(state.world_version, reason))
    return replace(state, pending_version=state.world_version)


def all_returned(state: JobState) -> bool:
    """Every member of the world the reports name, still registered, returned in it at one commit
    step (the job's success): the current world, or the one before a switch never made (its
    joiners never trained, and hold no part of the job)."""
    members = [state.workers[m.worker_id] for m in state.world if m.worker_id in state.workers]
    version = max((w.returned_in for w in members), default=0)
    held = [w for w in members if w.member_since <= version]
    return version > 0 and bool(held) and all(w.returned_in == version for w in held) and \
        len({w.returned_step for w in held}) == 1


def _remove(state: JobState, worker_id: str, reason: str, now: float, actions: list[Action], *,
            failure: bool, config: DecisionConfig, count_failure: bool = True,
            cause: Departure = Departure.LEFT) -> JobState:
    worker = state.workers.get(worker_id)
    if worker is None:
        return state
    state = replace(state, workers=without(state.workers, worker_id))
    actions.append(Dropped(worker_id, reason, cause))
    if failure and count_failure:
        state = _count_host_failure(state, worker.host, now, config)
    if state.in_world(worker_id):
        if failure:
            state = _abort(state, reason, actions)
        else:
            state = _pending(state, reason, actions)
        state = _mark_change(state, now)
    return state


def _count_host_failure(state: JobState, host: str, now: float, config: DecisionConfig) -> JobState:
    rec = state.hosts.get(host, HostRecord())
    rec = replace(rec, failures=rec.failures + 1)
    state = replace(state, hosts={**state.hosts, host: rec})
    if config.blacklist_after and rec.failures >= config.blacklist_after:  # 0: never
        state = _cool_down(state, host, now, config)
    return state


def _cool_down(state: JobState, host: str, now: float, config: DecisionConfig) -> JobState:
    """Blacklists `host` for its next cooldown (doubling with each), unless this server never
    blacklists (`blacklist_after` 0). One already cooling keeps the later end."""
    if not config.blacklist_after:
        return state
    rec = state.hosts.get(host, HostRecord())
    cooldown = min(config.cooldown_max_s, config.cooldown_min_s * 2 ** rec.blacklistings)
    rec = HostRecord(failures=0, blacklistings=rec.blacklistings + 1,
                     blacklisted_until=max(rec.blacklisted_until, now + cooldown))
    return replace(state, hosts={**state.hosts, host: rec})


def _evaluate(state: JobState, now: float, config: DecisionConfig,
              actions: list[Action]) -> tuple[JobState, list[Action]]:
    state = _reset_expired_blacklists(state, now)
    alive = eligible_count(state, now)
    if alive < state.spec.min_np:
        since = state.below_min_since if state.below_min_since is not None else now
        state = replace(state, below_min_since=since,
                        phase=Phase.WAITING if state.world else Phase.FORMING)
        if now - since >= state.spec.elastic_timeout_s:
            reason = (f"job {state.job_id}: only {alive} eligible worker(s), below min_np="
                      f"{state.spec.min_np}, for the elastic timeout of "
                      f"{state.spec.elastic_timeout_s:g} s")
            state = replace(state, phase=Phase.FAILED, reason=reason, change_first=None,
                            change_last=None, finished_at=now)
            actions.append(AnnounceFinished(False, reason))
        return state, actions
    state = replace(state, below_min_since=None)
    if state.change_last is None:
        return state, actions
    due = min(state.change_last + config.settle_s, state.change_first + config.settle_max_s)
    if now < due and not abort_acknowledged(state):
        return state, actions
    members = compute_world(state, now)
    state = replace(state, change_first=None, change_last=None, abort_acks=())
    # The same members, whatever order their commit steps would give them now: rank 0 is chosen
    # when a world forms, and a change that leaves the members as they are (a spare joining a full
    # world, a standby attaching) must not re-form a running job only because steps moved on.
    unchanged = ({(m.worker_id, m.ring_address) for m in members}
                 == {(m.worker_id, m.ring_address) for m in state.world})
    # Re-announcing an unchanged world is needed after an abort (the ring broke) and after a pending
    # notice (its members wait for a version > V, e.g. a newcomer that left within the window).
    if (unchanged and state.world and state.aborted_version != state.world_version
            and state.pending_version != state.world_version):
        return state, actions  # e.g. a standby joined a full world: nothing to re-form
    version = state.world_version + 1
    newcomers = {m.worker_id: replace(state.workers[m.worker_id], member_since=version)
                 for m in members if not state.workers[m.worker_id].member_since}
    state = replace(state, world_version=version, world=members, phase=Phase.RUNNING, reason="",
                    workers=updated(state.workers, newcomers) if newcomers else state.workers)
    actions.append(AnnounceWorld(version, members, tuple(state.standby())))
    return state, actions


def compute_world(state: JobState, now: float) -> tuple[Member, ...]:
    """The next world's members in rank order (see the module docstring for the rules)."""
    chosen = eligible(state, now)[:state.spec.max_np]
    if not chosen:
        return ()
    # Highest commit step first; max() keeps the earliest (lowest old rank) among ties.
    best = max(range(len(chosen)), key=lambda i: (state.workers[chosen[i]].commit_step, -i))
    chosen.insert(0, chosen.pop(best))
    # Group by host in order of each host's first appearance; stable within a host.
    host_order: list[str] = []
    by_host: dict[str, list[str]] = {}
    for w in chosen:
        h = state.workers[w].host
        if h not in by_host:
            host_order.append(h)
            by_host[h] = []
        by_host[h].append(w)
    # cross rank/size as Horovod defines them: among the hosts that have a worker with this local rank.
    # Counted in one pass (O(N), not O(N x hosts)): hosts_with[lr] is how many hosts have a
    # worker of local rank lr, and a host's cross rank is how many came before it.
    hosts_with = [0] * max((len(ws) for ws in by_host.values()), default=0)
    for h in host_order:
        for local_rank in range(len(by_host[h])):
            hosts_with[local_rank] += 1
    seen_with = [0] * len(hosts_with)
    members = []
    for h in host_order:
        for local_rank, w in enumerate(by_host[h]):
            worker = state.workers[w]
            members.append(Member(worker_id=w, host=h, ring_address=worker.ring_address,
                                  rank=len(members), local_rank=local_rank,
                                  local_size=len(by_host[h]),
                                  cross_rank=seen_with[local_rank], cross_size=hosts_with[local_rank],
                                  commit_step=worker.commit_step))
            seen_with[local_rank] += 1
    return tuple(members)
