"""The rendezvous gRPC service (grpc.aio): turns RPCs and stream breaks into decision events.

Shape: every job's membership lives in a `decision.JobState` value. An RPC or a liveness signal becomes
an event; `decision.decide` returns the next state and actions; the state is written to the store
(fenced by leadership, compare-and-swap on its revision, group-committed so a burst of 1,024 joins is a
handful of writes) and only then are the actions sent on the workers' Watch streams. Because every
announced world is durable before anyone sees it, a restarted server or a new leader reloads the same
worlds and changes nothing; workers simply reattach their sessions.

Liveness, measured (bench/rendezvous_scale.py, tests/rendezvous/test_server.py):
* A crashed worker's stream breaks at once (socket EOF/RST) and the grpc.aio handler is cancelled: we
  evict in milliseconds, well inside the 0.3 s budget with the settle window.
* A stopped or partitioned worker keeps its TCP connection, so the stream does not break. Python-level
  heartbeats would detect it, but they starve whenever training code holds the GIL (TorchElastic's
  own warning) and cost one RPC per worker per period. HTTP/2 keepalive pings are answered by gRPC's
  C core without the GIL, cost nothing in Python on either side, and a stopped process answers none:
  the server pings every heartbeat_timeout/3 and drops the connection when an ack is
  heartbeat_timeout/3 late (so a stopped worker is cut within 2/3 of the timeout), which cancels the
  stream and evicts the worker. So the open stream plus keepalive is the liveness signal; the Heartbeat
  RPC only carries progress (committed step) and probe answers.
* A peer's ReportFailure is evidence, not a verdict. It evicts at once only a suspect without a
  stream that had one under this leader. Right after a leader change or restart nobody has a stream
  yet, so a suspect that has not reattached gets until the heartbeat timeout since leadership began
  to do so. A suspect with a stream is probed; if its (Python) client does not answer, e.g. because
  training code holds the GIL, we trust keepalive: the report waits up to the heartbeat timeout for
  the stream to break, and evicts nobody while the connection stays alive. Only a report that does
  evict counts against the suspect's host, and not when the suspect never reattached after a leader
  change (the server's doing as much as the host's).
* A worker must open its Watch within heartbeat_timeout of joining; until it has, it is not put into a
  world (it could not learn about it).
* After a leader change or restart nobody has a stream yet: each registered worker gets the reattach
  window (heartbeat timeout + leader lease TTL + client reconnect allowance) before it is evicted, and
  such evictions are not counted against its host.
* Committed steps (Heartbeat, Watch) are soft state: they update the in-memory job state and ride along
  with the next real change that is written; a client resends its step when it reattaches.
* A job that has no world yet and no open Watch for the heartbeat timeout is dropped: joins that never
  watch cannot hold places under the job cap.

Who may do what (issue 11):
* A job belongs to the token that created it (the state keeps its SHA-256): a caller with another
  accepted token is refused at Join (PERMISSION_DENIED), sees nothing of it in Status, and its
  session ids name an unknown job. With --insecure there is no token, so nobody is told apart:
  anyone who can reach the server can join any job.
* Each job's ring secret is 32 random bytes made when the job (each run of its id) is created,
  stored with it and given only to accepted joiners.
* A session id is a capability: JOB/RUN/WORKER/SECRET with 192 random bits; the state keeps the
  secret's SHA-256, compared in constant time. A Join naming a registered worker must present its
  current session, or is refused (ALREADY_EXISTS) and the worker keeps it. ReportSuccess and
  ReportFailure count only from members of the world they name.
* A finished job refuses joins (FAILED_PRECONDITION, with its outcome) for the reattach window, so
  every member learns how it ended; after that a Join without a previous session, by the same
  token, starts a new run under the id (new secret, new sessions).
* Text a peer chose (a failure reason) is escaped and shortened before it is logged or sent on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import grpc
from grpc import aio

from . import decision as d
from ._proto import rendezvous_pb2 as pb
from ._proto import rendezvous_pb2_grpc as pb_grpc
from .config import ServerConfig, credential_of
from .leader import Leadership
from .store import MemoryStore, Store, StoreError

log = logging.getLogger("rendezvous.server")

# Used with fullmatch: `$` in re.match would also accept a trailing newline.
ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
HOST_RE = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}")
ADDR_RE = re.compile(r"[A-Za-z0-9._\-\[\]:]{1,255}:[0-9]{1,5}")
# JOB/RUN/WORKER/SECRET: the job and worker route the lookup; the secret decides.
SESSION_RE = re.compile(r"([A-Za-z0-9._-]{1,128})/([0-9a-f]{8})/([A-Za-z0-9._-]{1,128})/([0-9a-f]{48})")
SESSION_SECRET_BYTES = 24     # 192 random bits
RING_SECRET_BYTES = 32
RECONNECT_ALLOWANCE_S = 2.0   # client backoff tops out at 1 s (x1.5 jitter) plus one connect
RESOLVE_TIMEOUT_S = 1.0       # a ring address's name must resolve within this (Join waits for it)
MAX_REASON = 1024
SHOWN_CHARS = 200             # peer-supplied text is cut to this in logs and events
_END = object()
# The credential (SHA-256 of the token) of the RPC being served; set by _Guard. "" without tokens.
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("rendezvous_caller", default="")


class _Abort(Exception):
    """Raised inside handlers to fail the RPC with a status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str, leader: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.leader = leader


@dataclass
class _Stream:
    session_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed_by_server: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)   # the handler returned


@dataclass
class _Job:
    state: d.JobState
    revision: int                          # store revision of the last durable state
    durable_state: Optional[d.JobState] = None  # the state as last written (what Watch snapshots show)
    seq: int = 0                           # in-memory change counter
    durable_seq: int = 0
    outbox: list = field(default_factory=list)          # (seq, action, world-at-action)
    streams: dict = field(default_factory=dict)         # worker_id -> _Stream
    attach_deadline: dict = field(default_factory=dict)  # worker_id -> wall time
    probes: dict = field(default_factory=dict)          # nonce -> Future
    durable: asyncio.Condition = field(default_factory=asyncio.Condition)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    flushing: bool = False
    timer: Optional[asyncio.Task] = None
    # Wall time at which the job is dropped if it still has no world and no open stream.
    idle_deadline: Optional[float] = None
    # Set (and replaced) whenever a stream attaches: what a report waiting for a suspect waits on.
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False                  # being removed from the store or replaced: RPCs retry


def new_session(job: d.JobState, worker_id: str) -> tuple[str, str]:
    """A fresh session id for `worker_id` and the hash the state keeps of it."""
    secret = secrets.token_hex(SESSION_SECRET_BYTES)
    return f"{job.job_id}/{job.run}/{worker_id}/{secret}", _session_hash(secret)


def _session_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """Text a peer chose, as it may appear in a log line or an event: characters that are not
    printable (newlines, terminal escapes, bidi overrides) written as escapes, at most `limit`
    characters, so it can neither forge log lines nor drive a terminal."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return out if len(out) <= limit else out[:limit - 3] + "..."


class RendezvousService(pb_grpc.RendezvousServicer):
    def __init__(self, config: ServerConfig, store: Store):
        self.config = config
        self.store = store
        self.dcfg = config.decision()
        self.jobs: dict[str, _Job] = {}
        self.leadership = Leadership(store, f"{config.etcd_prefix}/leader",
                                     f"{config.replica_id}|{config.advertise_address}",
                                     config.leader_ttl_s, self._lost_leadership)
        self._leading = False
        self._leading_since = 0.0              # monotonic: when this replica last became leader
        self.leadership_losses = 0
        self.stopping = False
        self._campaign: Optional[asyncio.Task] = None
        self._creating: dict[str, asyncio.Task] = {}
        self._nonce = int(time.time() * 1000) << 16
        # Name lookups of ring addresses get threads of their own: a slow resolver must not hold
        # the default executor, where the store's calls (and the leader's lease refresh) run.
        self._resolver = concurrent.futures.ThreadPoolExecutor(max_workers=4,
                                                               thread_name_prefix="rdzv-resolve")

    # ----------------------------------------------------------------------------- leadership
    @property
    def is_leader(self) -> bool:
        # Checked against the lease clock too: after a stall (e.g. the process was stopped) the
        # watchdog may not have run yet, but nothing may be served on a lease etcd may have expired.
        return self._leading and self.leadership.valid()

    def reattach_window_s(self) -> float:
        return (self.config.heartbeat_timeout_s + self.config.leader_ttl_s
                + RECONNECT_ALLOWANCE_S)

    def start(self) -> None:
        self._campaign = asyncio.get_running_loop().create_task(self._become_leader())

    async def _become_leader(self) -> None:
        await self.leadership.campaign()
        try:
            items = await self.store.get_prefix(f"{self.config.etcd_prefix}/jobs/")
        except StoreError as e:
            log.error("leader: cannot load jobs (%s); resigning", e)
            await self.leadership.resign()
            self._campaign = asyncio.get_running_loop().create_task(self._become_leader())
            return
        if not self.leadership.valid():
            # The lease lapsed while the jobs loaded (etcd stalled meanwhile): the watchdog's
            # loss went unheard, since this replica was not serving yet. Start over, or it
            # would serve nothing, forever, believing it leads.
            log.warning("replica %s: leadership lapsed while loading jobs; campaigning again",
                        self.config.replica_id)
            self.leadership.drop()
            self._campaign = asyncio.get_running_loop().create_task(self._become_leader())
            return
        window = self.reattach_window_s()
        grace = time.time() + window
        self.jobs = {}
        for versioned in items.values():
            state = d.from_json(versioned.value)
            job = _Job(state=state, revision=versioned.revision, durable_state=state)
            if state.phase not in d.TERMINAL:
                what = f"did not reattach within {window:g} s of a leader change"
                job.attach_deadline = {w: (grace, what) for w in state.workers}
                job.idle_deadline = grace
            self.jobs[state.job_id] = job
            self._start_timer(job)
        self._leading = True
        self._leading_since = time.monotonic()
        log.info("replica %s is the leader (%d job(s) loaded; workers have %.1f s to reattach)",
                 self.config.replica_id, len(self.jobs), window)

    def _lost_leadership(self, reason: str) -> None:
        """Stop acting as leader at once: end every stream (clients go to the next leader)."""
        if not self._leading:
            return
        log.warning("replica %s lost leadership: %s", self.config.replica_id, reason)
        self.leadership_losses += 1
        self._leading = False
        self.leadership.drop()
        for job in self.jobs.values():
            if job.timer:
                job.timer.cancel()
            for stream in job.streams.values():
                stream.closed_by_server = True   # the client reconnects to the new leader
                stream.queue.put_nowait(_END)
            for fut in job.probes.values():
                fut.cancel()
        self.jobs = {}
        if not self.stopping:
            self._campaign = asyncio.get_running_loop().create_task(self._become_leader())

    async def shutdown(self) -> None:
        """Graceful stop: end streams without evicting anyone and hand leadership over at once."""
        self.stopping = True
        if self._campaign and not self._campaign.done():
            self._campaign.cancel()
        for job in self.jobs.values():
            if job.timer:
                job.timer.cancel()
            for stream in job.streams.values():
                stream.closed_by_server = True
                stream.queue.put_nowait(_END)
        # Let pending group commits land before the lease goes.
        for job in self.jobs.values():
            if job.seq > job.durable_seq:
                try:
                    await asyncio.wait_for(self._wait_durable(job, job.seq), 2.0)
                except Exception:
                    pass
        self._leading = False
        await self.leadership.resign()
        self._resolver.shutdown(wait=False)

    async def _leader_hint(self) -> str:
        try:
            # Bounded: this replica may be the one whose store connection stalls.
            current = await asyncio.wait_for(self.leadership.current_leader(), 0.5)
        except (StoreError, asyncio.TimeoutError):
            return ""
        return current.split("|", 1)[1] if current and "|" in current else ""

    async def _require_leader(self) -> None:
        if self.stopping:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down; try another address")
        if not self.is_leader:
            hint = await self._leader_hint()
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"replica {self.config.replica_id} is not the rendezvous leader"
                         + (f"; the leader is at {hint}" if hint else "; no leader elected yet"),
                         leader=hint)

    # -------------------------------------------------------------------------- state changes
    def _apply(self, job: _Job, event: d.Event) -> tuple[int, list]:
        """Decide; queue the actions for after the next durable write. Returns (seq, actions)."""
        now = time.time()
        world_before = job.state.world
        state, actions = d.decide(job.state, event, now, self.dcfg)
        if state is not job.state:
            job.state = state
            if isinstance(event, d.Progress) and not actions:
                # Soft state: not worth a write of the whole job per report. It is stored with the
                # next real change, and resent by the client on reattach / next heartbeat.
                return job.seq, actions
            job.seq += 1
            for a in actions:
                if not isinstance(a, d.Rejected):
                    job.outbox.append((job.seq, a, world_before))
            self._kick_flush(job)
        job.wake.set()
        return job.seq, actions

    def _log_action(self, job: _Job, a) -> None:
        jid = job.state.job_id
        if isinstance(a, d.Announce):
            log.info("job %s: world %d announced: %d member(s), %d standby", jid, a.version,
                     len(a.members), len(a.standby))
        elif isinstance(a, d.Abort):
            log.info("job %s: abort world %d: %s", jid, a.version, a.reason)
        elif isinstance(a, d.Pending):
            log.info("job %s: change pending for world %d: %s", jid, a.version, a.reason)
        elif isinstance(a, d.Dropped):
            log.info("job %s: worker %s dropped: %s", jid, a.worker_id, a.reason)
        elif isinstance(a, d.Finished):
            log.info("job %s: finished (%s): %s", jid, "succeeded" if a.succeeded else "failed",
                     a.reason)

    def _kick_flush(self, job: _Job) -> None:
        if not job.flushing:
            job.flushing = True
            asyncio.get_running_loop().create_task(self._flush(job))

    async def _flush(self, job: _Job) -> None:
        """Group commit: write the latest state, then send every action that state covers."""
        key = f"{self.config.etcd_prefix}/jobs/{job.state.job_id}"
        backoff = 0.05
        unsure: list[bytes] = []   # writes whose outcome we did not learn (error, lost response)
        try:
            while job.durable_seq < job.seq and self.is_leader:
                seq, state = job.seq, job.state
                data = d.to_json(state)
                try:
                    rev = await self.store.put(key, data, expected_revision=job.revision,
                                               fence=self.leadership.fence)
                    if rev is None and unsure:
                        # CAS refused after an ambiguous write: if that write did land, the key
                        # holds exactly our bytes and we are still the one writing this job.
                        cur = await self.store.get(key)
                        if cur is not None and cur.value in unsure:
                            log.info("job %s: an earlier write did land (revision %d); continuing",
                                     job.state.job_id, cur.revision)
                            job.revision = cur.revision
                            unsure = []
                            continue
                except StoreError as e:
                    log.warning("job %s: writing state failed: %s; retrying", job.state.job_id, e)
                    unsure.append(data)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                if rev is None:
                    self._lost_leadership(f"fenced write of job {job.state.job_id} refused: "
                                          f"another replica leads or wrote it")
                    return
                unsure = []
                job.revision = rev
                job.durable_seq = seq
                job.durable_state = state
                ready = [x for x in job.outbox if x[0] <= seq]
                job.outbox = [x for x in job.outbox if x[0] > seq]
                for _, action, world_before in ready:
                    self._dispatch(job, action, world_before)
                async with job.durable:
                    job.durable.notify_all()
        finally:
            job.flushing = False

    async def _wait_durable(self, job: _Job, seq: int) -> None:
        try:
            async with job.durable:
                await asyncio.wait_for(job.durable.wait_for(lambda: job.durable_seq >= seq
                                                            or not self.is_leader), 10.0)
        except asyncio.TimeoutError:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"job {job.state.job_id}: the store did not "
                                                      f"acknowledge the change within 10 s") from None
        if job.durable_seq < seq:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "leadership lost before the change was stored; "
                                                      "retry against the new leader")

    def _send(self, job: _Job, worker_id: str, event: pb.WatchEvent) -> None:
        stream = job.streams.get(worker_id)
        if stream is not None:
            stream.queue.put_nowait(event)

    def _dispatch(self, job: _Job, action, world_before) -> None:
        self._log_action(job, action)   # logged when it takes effect (durable, sent), not decided
        if isinstance(action, d.Announce):
            # The member list is serialized once; each recipient's own rank fields are appended as
            # bytes (protobuf merges concatenated messages). At 1,024 workers this turns 1,024
            # serializations of a ~100 KB message into memory copies.
            base = pb.World(version=action.version, size=len(action.members),
                            members=[_member_pb(m) for m in action.members]).SerializeToString()
            for m in action.members:
                if m.worker_id in job.streams:
                    inner = base + pb.World(rank=m.rank, local_rank=m.local_rank,
                                            local_size=m.local_size, cross_rank=m.cross_rank,
                                            cross_size=m.cross_size).SerializeToString()
                    self._send(job, m.worker_id, _WORLD_FIELD + _varint(len(inner)) + inner)
            for w in action.standby:
                self._send(job, w, pb.WatchEvent(standby=pb.Standby(
                    world_version=action.version, reason="beyond max_np: hot spare")))
        elif isinstance(action, (d.Pending, d.Abort)):
            event = (pb.WatchEvent(pending=pb.MembershipPending(world_version=action.version,
                                                                reason=action.reason))
                     if isinstance(action, d.Pending) else
                     pb.WatchEvent(abort=pb.AbortVersion(world_version=action.version,
                                                         reason=action.reason)))
            for m in world_before:
                self._send(job, m.worker_id, event)
        elif isinstance(action, d.Dropped):
            # (Its attach deadline stays: after a rejoin it is the new session's; a stale one finds
            # nobody to evict.)
            stream = job.streams.pop(action.worker_id, None)
            if stream is not None:
                stream.closed_by_server = True
                stream.queue.put_nowait(_Abort(grpc.StatusCode.NOT_FOUND,
                                               f"session ended: {action.reason}"))
                self._stream_gone(job)
        elif isinstance(action, d.Finished):
            event = pb.WatchEvent(finished=pb.JobFinished(succeeded=action.succeeded,
                                                          reason=action.reason))
            for stream in job.streams.values():
                stream.closed_by_server = True
                stream.queue.put_nowait(event)
                stream.queue.put_nowait(_END)
            job.streams.clear()

    def _start_timer(self, job: _Job) -> None:
        job.timer = asyncio.get_running_loop().create_task(self._timer(job))

    def _stream_gone(self, job: _Job) -> None:
        """A stream left `job.streams`: the last one going starts the idle clock of a job that has
        no world yet."""
        if not job.streams and job.idle_deadline is None:
            job.idle_deadline = time.time() + self.config.heartbeat_timeout_s
            job.wake.set()

    async def _timer(self, job: _Job) -> None:
        """Fires settle windows, elastic timeouts, reattach deadlines, probe deadlines, and drops a
        job nobody watches before it has a world."""
        while job.state.phase not in d.TERMINAL:
            deadlines = [t for t in [d.next_deadline(job.state, self.dcfg), job.idle_deadline,
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
                    if w not in job.streams and self.is_leader:
                        # The server's own doing (failover, restart) as much as the worker's:
                        # not counted against the host.
                        self._evict(job, w, what, count_failure=False)
            if job.idle_deadline is not None and job.idle_deadline <= now:
                if job.streams or job.state.phase is not d.Phase.FORMING:
                    job.idle_deadline = None
                elif self.is_leader:
                    if await self._retire(job, f"dropped: no world and no worker watching it for "
                                               f"{self.config.heartbeat_timeout_s:g} s"):
                        return
                    job.idle_deadline = time.time() + self.config.heartbeat_timeout_s  # retry
            due = d.next_deadline(job.state, self.dcfg)
            if due is not None and due <= now:
                self._apply(job, d.Tick())
        await self._forget_when_expired(job)

    async def _forget_when_expired(self, job: _Job) -> None:
        """Keep a finished job (for status, and to refuse late joiners) for a while, then drop it."""
        finished_at = job.state.finished_at if job.state.finished_at is not None else time.time()
        await asyncio.sleep(max(0.0, finished_at + self.config.finished_job_retention_s - time.time()))
        await self._retire(job, f"finished {self.config.finished_job_retention_s:.0f} s ago, forgotten")

    async def _retire(self, job: _Job, why: str) -> bool:
        """Remove the job from the store and from memory; False if the store failed (try later).

        RPCs that find the job meanwhile are answered UNAVAILABLE (they retry, and then find no
        job), and the delete is conditional on the revision last written, so no change can slip
        in between that write and the delete."""
        job_id = job.state.job_id
        key = f"{self.config.etcd_prefix}/jobs/{job_id}"
        if self.jobs.get(job_id) is not job:
            return True
        job.closing = True
        try:
            if job.seq > job.durable_seq:
                await self._wait_durable(job, job.seq)
            ok = await self.store.delete(key, expected_revision=job.revision,
                                         fence=self.leadership.fence)
            # Refused: unless an earlier attempt (its answer lost) deleted it, someone else wrote.
            gone = ok or await self.store.get(key) is None
        except (StoreError, _Abort) as e:  # the next leader retries when it loads the job
            job.closing = False
            log.warning("job %s: removing it failed: %s", job_id, getattr(e, "message", e))
            return False
        if not gone:
            job.closing = False
            self._lost_leadership(f"fenced delete of job {job_id} refused: another replica leads "
                                  f"or wrote it")
            return True
        if self.jobs.get(job_id) is job:
            del self.jobs[job_id]
        log.info("job %s: %s", job_id, why)
        return True

    def _evict(self, job: _Job, worker_id: str, reason: str, count_failure: bool = True) -> None:
        w = job.state.workers.get(worker_id)
        if w is None:
            return
        self._apply(job, d.Evict(worker_id, f"worker {worker_id} on host {w.host} evicted: {reason}",
                                 count_failure))

    # ------------------------------------------------------------------------------- lookups
    def _job(self, job_id: str) -> Optional[_Job]:
        """The caller's job of that id; None when there is none or it belongs to another token."""
        job = self.jobs.get(job_id)
        if job is None or not hmac.compare_digest(job.state.credential, _CALLER.get()):
            return None
        if job.closing:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"job {job_id} is being removed or "
                                                      f"replaced; retry")
        return job

    def _session(self, sid: str) -> tuple[_Job, d.Worker]:
        m = SESSION_RE.fullmatch(sid) if len(sid) <= 400 else None
        if m is None:
            # Not echoed: it may be a real session id, mangled.
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         "malformed session_id: expected the session_id a Join returned")
        job_id, run, worker_id, secret = m.groups()
        job = self._job(job_id)
        if job is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job_id!r}: join again")
        w = job.state.workers.get(worker_id)
        # Compared in constant time, and the same answer whether the worker id exists or not.
        matches = hmac.compare_digest(_session_hash(secret), w.session_hash if w else "0" * 64)
        if w is None or run != job.state.run or not matches:
            if job.state.phase in d.TERMINAL:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {job_id} finished ({job.state.phase.value}: {job.state.reason})")
            raise _Abort(grpc.StatusCode.NOT_FOUND,
                         f"job {job_id}: not a current session of worker {worker_id} (evicted, "
                         f"left, rejoined, or never issued): join again")
        return job, w

    # ---------------------------------------------------------------------------------- RPCs
    async def Join(self, request, context):
        await self._require_leader()
        _check_id("job_id", request.job_id)
        _check_id("worker_id", request.worker_id)
        if not HOST_RE.fullmatch(request.host):
            raise _bad("host", request.host, "1..255 chars of [A-Za-z0-9._:[]-]")
        if request.committed_step < -1:
            raise _bad("committed_step", request.committed_step, ">= -1")
        spec = request.spec
        timeout = spec.elastic_timeout_s
        if timeout != timeout or timeout < 0 or timeout > 7 * 86400:  # NaN or out of range
            raise _bad("spec.elastic_timeout_s", timeout, "0..604800 (0: server default)")
        previous = None   # (run, secret) of the session this worker says it had
        if request.session_id:
            m = SESSION_RE.fullmatch(request.session_id) if len(request.session_id) <= 400 else None
            if m is None or m.group(1) != request.job_id or m.group(3) != request.worker_id:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"invalid session_id: expected a session of worker {request.worker_id}"
                             f" in job {request.job_id} as a Join returned it, or none")
            previous = m.group(2), m.group(4)
        await self._check_ring_address(request.ring_address)
        caller = _CALLER.get()
        job = self.jobs.get(request.job_id)
        if job is not None and not hmac.compare_digest(job.state.credential, caller):
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"job {request.job_id} belongs to another token: this one cannot join it")
        if job is not None and job.closing:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"job {request.job_id} is being removed or "
                                                      f"replaced; retry")
        relaunch = (job is not None and job.state.phase in d.TERMINAL and previous is None
                    and time.time() >= (job.state.finished_at or 0.0) + self.reattach_window_s())
        if job is None or relaunch:
            job = await self._create_job(request.job_id, self._new_spec(request.job_id, spec), caller,
                                         replacing=job)
            if not hmac.compare_digest(job.state.credential, caller):  # a concurrent creation won
                raise _Abort(grpc.StatusCode.PERMISSION_DENIED, f"job {request.job_id} belongs to "
                                                                f"another token: this one cannot join it")
        elif job.state.phase not in d.TERMINAL:
            if not job.state.ring_secret or not job.state.run:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {request.job_id} was created by an older server, without a ring "
                             f"secret: no worker can join it; launch it under another id")
            have = job.state.spec
            if (spec.min_np and spec.min_np != have.min_np) or (spec.max_np and spec.max_np != have.max_np):
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {request.job_id} has min_np={have.min_np} max_np={have.max_np}; "
                             f"this join asks for min_np={spec.min_np} max_np={spec.max_np}")
            if previous is not None and previous[0] != job.state.run:
                # Its run ended and the id was launched again: state it kept from the old run must
                # not become this run's (it could hold the highest step and be synced to all).
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {request.job_id}: the run that worker {request.worker_id}'s "
                             f"session belonged to is over and a new run started; it cannot rejoin")
            if (request.worker_id not in job.state.workers
                    and len(job.state.workers) >= self.config.max_workers_per_job):
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"job {request.job_id} already has {len(job.state.workers)} workers")
        sid, session_hash = new_session(job.state, request.worker_id)
        proof = _session_hash(previous[1]) if previous is not None else ""
        seq, actions = self._apply(job, d.Join(request.worker_id, request.host,
                                                request.ring_address, request.committed_step,
                                                attached=False, session_hash=session_hash,
                                                proof=proof))
        for a in actions:
            if isinstance(a, d.Rejected):
                raise _Abort(_REFUSAL_CODES[a.kind],
                             f"job {request.job_id}: worker {request.worker_id} refused: {a.reason}")
        # It must open its Watch within the heartbeat timeout; until then it is kept out of worlds.
        job.attach_deadline[request.worker_id] = (
            time.time() + self.config.heartbeat_timeout_s,
            f"did not open its watch stream within {self.config.heartbeat_timeout_s:g} s of joining")
        job.wake.set()
        await self._wait_durable(job, seq)
        s = job.state.spec
        return pb.JoinResponse(session_id=sid, world_version=job.state.version,
                               spec=pb.JobSpec(min_np=s.min_np, max_np=s.max_np,
                                               elastic_timeout_s=s.elastic_timeout_s),
                               ring_secret=bytes.fromhex(job.state.ring_secret))

    def _new_spec(self, job_id: str, spec) -> d.JobSpec:
        """The spec of a job this Join creates; refuses bad limits and a full server."""
        if spec.min_np < 1 or spec.max_np < spec.min_np or spec.max_np > self.config.max_workers_per_job:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"job {job_id}: spec needs 1 <= min_np <= max_np <= "
                         f"{self.config.max_workers_per_job}, got min_np={spec.min_np} "
                         f"max_np={spec.max_np}")
        running = sum(1 for j in self.jobs.values() if j.state.phase not in d.TERMINAL)
        if running >= self.config.max_jobs:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"server runs {running} jobs, the limit")
        return d.JobSpec(spec.min_np, spec.max_np,
                         spec.elastic_timeout_s or self.config.default_elastic_timeout_s)

    async def _check_ring_address(self, address: str) -> None:
        """INVALID_ARGUMENT unless every member could connect to `address`: HOST:PORT, port
        1..65535, not a wildcard, an IP literal or a name that resolves (within a second). Checked
        here, once, because a bad address in a world would make every member's ring fail."""
        rule = "HOST:PORT with port 1..65535"
        if not ADDR_RE.fullmatch(address):
            raise _bad("ring_address", address, rule)
        host, _, port_text = address.rpartition(":")
        port = int(port_text)
        if not 0 < port < 65536:
            raise _bad("ring_address", address, rule)
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif "[" in host or "]" in host:
            raise _bad("ring_address", address, "HOST:PORT or [IPv6]:PORT")
        not_wildcard = ("an address other hosts can connect to, not a wildcard (set "
                        "ELASTIC_RING_HOST to an address of this host)")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            if ip.is_unspecified or ip.is_multicast:
                raise _bad("ring_address", address, not_wildcard)
            return
        if not host:
            raise _bad("ring_address", address, not_wildcard)
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.run_in_executor(
                self._resolver, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM),
                RESOLVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise _bad("ring_address", address, f"a host name that resolves; {host} did not "
                                                f"within {RESOLVE_TIMEOUT_S:g} s") from None
        except (OSError, UnicodeError) as e:
            raise _bad("ring_address", address, f"a host name that resolves; {host} does not "
                                                f"({getattr(e, 'strerror', None) or e})") from None
        addresses = {info[4][0].split("%", 1)[0] for info in infos}
        if not addresses or all(ipaddress.ip_address(a).is_unspecified for a in addresses):
            raise _bad("ring_address", address, not_wildcard)

    async def _create_job(self, job_id: str, spec: d.JobSpec, credential: str,
                          replacing: Optional[_Job] = None) -> _Job:
        # Concurrent first joins of one job share a single creation.
        creating = self._creating.get(job_id)
        if creating is None:
            creating = asyncio.get_running_loop().create_task(
                self._create_job_once(job_id, spec, credential, replacing))
            self._creating[job_id] = creating
            creating.add_done_callback(lambda _: self._creating.pop(job_id, None))
        return await asyncio.shield(creating)

    async def _create_job_once(self, job_id: str, spec: d.JobSpec, credential: str,
                               replacing: Optional[_Job]) -> _Job:
        """Create the job, or a new run of a finished one (`replacing`), with a fresh ring secret."""
        if replacing is not None:
            await self._wait_durable(replacing, replacing.seq)   # finished: nothing changes after
            replacing.closing = True
            if replacing.timer:
                replacing.timer.cancel()
        state = d.new_job(job_id, spec, time.time(), credential=credential,
                          ring_secret=secrets.token_bytes(RING_SECRET_BYTES).hex(),
                          run=secrets.token_hex(4))
        key = f"{self.config.etcd_prefix}/jobs/{job_id}"
        data = d.to_json(state)
        expected = replacing.revision if replacing is not None else 0
        try:
            try:
                rev = await self.store.put(key, data, expected_revision=expected,
                                           fence=self.leadership.fence)
            except StoreError as e:
                # Ambiguous: it may have landed. Re-read once; otherwise the client retries the Join.
                try:
                    cur = await self.store.get(key)
                except StoreError:
                    cur = None
                if cur is None or cur.value != data:
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, f"job {job_id}: cannot create it in "
                                                              f"the store ({e}); retry") from None
                rev = cur.revision
        except _Abort:
            if replacing is not None and self.jobs.get(job_id) is replacing:
                replacing.closing = False
                self._start_timer(replacing)   # it is still the job: it must still be forgotten
            raise
        if rev is None:  # only the leader creates jobs: someone else leads, or wrote it
            self._lost_leadership(f"fenced create of job {job_id} refused")
            await self._require_leader()
        if not self.is_leader:
            await self._require_leader()
        job = _Job(state=state, revision=rev, durable_state=state,
                   idle_deadline=time.time() + self.config.heartbeat_timeout_s)
        self.jobs[job_id] = job
        self._start_timer(job)
        if replacing is not None:
            log.info("job %s: launched again (the previous run %s)", job_id,
                     replacing.state.phase.value)
        return job

    async def Watch(self, request, context):
        await self._require_leader()
        job, w = self._session(request.session_id)
        old = job.streams.get(w.worker_id)
        if old is not None:  # the worker reconnected before we noticed the old stream break
            old.closed_by_server = True
            old.queue.put_nowait(_Abort(grpc.StatusCode.CANCELLED, "replaced by a newer Watch"))
        stream = _Stream(request.session_id)
        try:
            await self._watch(job, w, request, context, stream)
        finally:
            stream.ended.set()

    async def _watch(self, job: _Job, w: d.Worker, request, context, stream: _Stream) -> None:
        job.streams[w.worker_id] = stream
        job.attach_deadline.pop(w.worker_id, None)
        job.idle_deadline = None
        job.attached.set()               # wakes reports waiting for this worker to reattach
        job.attached = asyncio.Event()
        if not w.attached:
            self._apply(job, d.Attach(w.worker_id))
        if request.committed_step > w.committed_step:   # resent on reattach: progress is soft state
            self._apply(job, d.Progress(w.worker_id, request.committed_step))
        # The snapshot is the last *stored* state: what is only in memory may still be lost (if the
        # write fails and another replica takes over); later changes follow through the outbox.
        state = job.durable_state if job.durable_state is not None else job.state
        member = state.member(w.worker_id)
        if state.phase in d.TERMINAL:
            await context.write(pb.WatchEvent(finished=pb.JobFinished(
                succeeded=state.phase is d.Phase.SUCCEEDED, reason=state.reason)))
            job.streams.pop(w.worker_id, None)
            return
        if member is not None:
            world = pb.World(version=state.version, size=len(state.world),
                             members=[_member_pb(m) for m in state.world], rank=member.rank,
                             local_rank=member.local_rank, local_size=member.local_size,
                             cross_rank=member.cross_rank, cross_size=member.cross_size)
            await context.write(pb.WatchEvent(world=world))
            if state.aborted_version == state.version:
                await context.write(pb.WatchEvent(abort=pb.AbortVersion(
                    world_version=state.version, reason="a member of this world failed")))
        else:
            await context.write(pb.WatchEvent(standby=pb.Standby(
                world_version=state.version,
                reason="no world formed yet" if not state.world else "beyond max_np: hot spare")))
        try:
            while True:
                item = await stream.queue.get()
                if item is _END:
                    return
                if isinstance(item, _Abort):
                    await context.abort(item.code, item.message)
                await context.write(item)
        finally:
            # Reached on a broken stream (client crashed, keepalive failed: the handler is
            # cancelled) and on server-side closes; only the former is the worker's failure.
            if not stream.closed_by_server and not self.stopping and self.is_leader:
                if job.streams.get(w.worker_id) is stream:
                    del job.streams[w.worker_id]
                    self._stream_gone(job)
                    cur = job.state.workers.get(w.worker_id)
                    if cur is not None and cur.join_seq == w.join_seq:
                        self._evict(job, w.worker_id, "watch stream broken")

    async def Heartbeat(self, request, context):
        await self._require_leader()
        if request.committed_step < -1:
            raise _bad("committed_step", request.committed_step, ">= -1")
        job, w = self._session(request.session_id)
        if request.probe_nonce:
            fut = job.probes.get(request.probe_nonce)
            if fut is not None and not fut.done():
                fut.set_result(w.worker_id)
        if request.committed_step > w.committed_step:
            self._apply(job, d.Progress(w.worker_id, request.committed_step))
        return pb.HeartbeatResponse(world_version=job.state.version)

    async def Leave(self, request, context):
        await self._require_leader()
        job, w = self._session(request.session_id)
        seq, _ = self._apply(job, d.Leave(w.worker_id))
        await self._wait_durable(job, seq)
        return pb.LeaveResponse()

    async def ReportFailure(self, request, context):
        await self._require_leader()
        _check_id("suspect_worker_id", request.suspect_worker_id)
        if len(request.reason) > MAX_REASON:
            raise _bad("reason", f"<{len(request.reason)} chars>", f"at most {MAX_REASON} chars")
        job, reporter = self._session(request.session_id)
        state = job.state
        if request.world_version != state.version:
            return pb.ReportFailureResponse(
                evicted=False, detail=f"stale report: world {request.world_version} is not the "
                                      f"current world {state.version}")
        if not state.in_world(reporter.worker_id):
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"job {state.job_id}: worker {reporter.worker_id} is not a member of world "
                         f"{state.version}; only its members report its failures")
        suspect = request.suspect_worker_id
        if suspect not in state.workers or not state.in_world(suspect):
            return pb.ReportFailureResponse(evicted=False, detail=f"{suspect} is not a member of "
                                                                  f"world {state.version} (already "
                                                                  f"evicted or left)")
        target = state.workers[suspect]
        why = f"reported by {reporter.worker_id}: {shown(request.reason) or 'unreachable'}"

        def same_suspect() -> bool:
            cur = job.state.workers.get(suspect)
            return cur is not None and cur.join_seq == target.join_seq

        if suspect not in job.streams and suspect in job.attach_deadline:
            # It has not reattached since this replica began leading (a failover or restart: no
            # worker has its stream back yet). Its silence says nothing yet: give it the heartbeat
            # timeout since leadership began.
            until = self._leading_since + self.config.heartbeat_timeout_s
            log.info("job %s: %s reported by %s has not reattached since this replica began leading;"
                     " waiting up to %.1f s for it", state.job_id, suspect, reporter.worker_id,
                     max(0.0, until - time.monotonic()))
            await self._await_stream(job, suspect, until)
            if not same_suspect():
                await self._wait_durable(job, job.seq)
                return pb.ReportFailureResponse(evicted=True, detail="suspect gone meanwhile")
        if request.unusable_address:
            # A probe answer would prove only that the suspect lives, not that its ring
            # address leads anywhere: alive or not, no ring of this job can include it.
            seq, _ = self._apply_evict(job, suspect, f"unusable ring address; {why}")
            await self._wait_durable(job, seq)
            return pb.ReportFailureResponse(evicted=True, detail="suspect's ring address is unusable")
        if suspect not in job.streams:
            # Never reattached under this leader: the server's doing as much as the host's.
            seq, _ = self._apply_evict(job, suspect, f"no watch stream; {why}",
                                       count_failure=suspect not in job.attach_deadline)
            await self._wait_durable(job, seq)
            return pb.ReportFailureResponse(evicted=True, detail="suspect had no watch stream")
        # The suspect has a stream, so keepalive vouches for it (answered by gRPC's C core, even while
        # its training code holds the GIL). Probe it, and wait up to the heartbeat timeout for either
        # a probe answer or the stream to break (a stopped/partitioned process fails keepalive).
        self._nonce += 1
        nonce = self._nonce
        fut = asyncio.get_running_loop().create_future()
        job.probes[nonce] = fut
        self._send(job, suspect, pb.WatchEvent(probe=pb.Probe(nonce=nonce)))
        deadline = time.monotonic() + self.config.heartbeat_timeout_s + 0.25
        try:
            while True:
                await self._require_leader()   # stepping down ends every stream: answer UNAVAILABLE
                if not same_suspect():
                    await self._wait_durable(job, job.seq)
                    return pb.ReportFailureResponse(evicted=True, detail="suspect's stream broke")
                stream = job.streams.get(suspect)
                if stream is None:
                    seq, _ = self._apply_evict(job, suspect, f"no watch stream; {why}")
                    await self._wait_durable(job, seq)
                    return pb.ReportFailureResponse(evicted=True, detail="suspect lost its stream")
                left = deadline - time.monotonic()
                if left <= 0:
                    await self._ring_broken(job, reporter.worker_id, request.world_version, why)
                    return pb.ReportFailureResponse(
                        evicted=False, detail=f"{suspect} did not answer the probe but its "
                                              f"connection stayed alive (keepalive) for "
                                              f"{self.config.heartbeat_timeout_s:g} s; world "
                                              f"{request.world_version} re-formed")
                if stream.ended.is_set():   # closed by us (shutting down): do not spin
                    await asyncio.sleep(min(left, 0.05))
                    continue
                ended = asyncio.ensure_future(stream.ended.wait())
                try:
                    await asyncio.wait([fut, ended], timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ended.cancel()
                if fut.done() and not fut.cancelled():
                    await self._ring_broken(job, reporter.worker_id, request.world_version, why)
                    return pb.ReportFailureResponse(evicted=False,
                                                    detail=f"{suspect} answered a probe; world "
                                                           f"{request.world_version} re-formed")
        finally:
            job.probes.pop(nonce, None)

    async def _await_stream(self, job: _Job, worker_id: str, until: float) -> None:
        """Wait until `worker_id` has a stream, is gone, or the monotonic time `until` passes."""
        while worker_id not in job.streams and worker_id in job.state.workers:
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(job.attached.wait(), left)
            except asyncio.TimeoutError:
                return
            await self._require_leader()

    async def _ring_broken(self, job: _Job, reporter_id: str, version: int, why: str) -> None:
        # Nobody is evicted, but the reporter's ring is broken: without a new version every
        # member would wait for a world that never comes.
        seq, _ = self._apply(job, d.RingBroken(reporter_id, version, f"ring of world {version} broken, "
                                                                      f"every member alive ({why})"))
        await self._wait_durable(job, seq)

    def _apply_evict(self, job: _Job, worker_id: str, reason: str, count_failure: bool = True):
        self._evict(job, worker_id, reason, count_failure)
        return job.seq, []

    async def ReportSuccess(self, request, context):
        await self._require_leader()
        job, w = self._session(request.session_id)
        seq, actions = self._apply(job, d.Success(w.worker_id, request.world_version))
        for a in actions:
            if isinstance(a, d.Rejected):
                raise _Abort(_REFUSAL_CODES[a.kind], a.reason)
        await self._wait_durable(job, seq)
        return pb.ReportSuccessResponse()

    async def Status(self, request, context):
        if request.job_id:
            _check_id("job_id", request.job_id)
        now = time.time()
        caller = _CALLER.get()
        if self.is_leader:
            jobs = {j: (job.state, set(job.streams)) for j, job in self.jobs.items()}
        else:  # all state is in the store: a follower can answer too (nobody is attached to it)
            try:
                items = await self.store.get_prefix(f"{self.config.etcd_prefix}/jobs/")
            except StoreError as e:
                raise _Abort(grpc.StatusCode.UNAVAILABLE, str(e))
            jobs = {}
            for v in items.values():
                state = d.from_json(v.value)
                jobs[state.job_id] = (state, set())
        # Only the caller's own jobs: another token's jobs are not even named.
        jobs = {j: v for j, v in jobs.items() if hmac.compare_digest(v[0].credential, caller)}
        out = pb.StatusResponse(leader_id=self.config.replica_id if self.is_leader else "")
        for job_id in sorted(jobs):
            if request.job_id and job_id != request.job_id:
                continue
            state, attached = jobs[job_id]
            js = out.jobs.add(job_id=job_id, world_version=state.version, phase=state.phase.value,
                              reason=state.reason,
                              spec=pb.JobSpec(min_np=state.spec.min_np, max_np=state.spec.max_np,
                                              elastic_timeout_s=state.spec.elastic_timeout_s),
                              blacklisted_hosts=state.blacklisted_hosts(now))
            for m in state.world:
                if m.worker_id in state.workers:
                    js.members.add(member=_member_pb(m), in_world=True,
                                   attached=m.worker_id in attached,
                                   age_s=now - state.workers[m.worker_id].joined_at)
            for wid in state.standby():
                w = state.workers[wid]
                js.members.add(member=pb.Member(worker_id=wid, host=w.host,
                                                ring_address=w.ring_address,
                                                committed_step=w.committed_step),
                               in_world=False, attached=wid in attached, age_s=now - w.joined_at)
        if request.job_id and not out.jobs:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"unknown job {request.job_id!r}")
        return out


_REFUSAL_CODES = {
    d.Refusal.FINISHED: grpc.StatusCode.FAILED_PRECONDITION,
    d.Refusal.BLACKLISTED: grpc.StatusCode.FAILED_PRECONDITION,
    d.Refusal.WORKER_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    d.Refusal.NOT_MEMBER: grpc.StatusCode.PERMISSION_DENIED,
}

_WORLD_FIELD = bytes([(pb.WatchEvent.WORLD_FIELD_NUMBER << 3) | 2])  # tag: field 1, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _member_pb(m: d.Member) -> pb.Member:
    return pb.Member(worker_id=m.worker_id, host=m.host, ring_address=m.ring_address, rank=m.rank,
                     local_rank=m.local_rank, local_size=m.local_size, cross_rank=m.cross_rank,
                     cross_size=m.cross_size, committed_step=m.committed_step)


def _check_id(name: str, value: str) -> None:
    if not ID_RE.fullmatch(value):
        raise _bad(name, value, "1..128 chars of [A-Za-z0-9._-]")


def _bad(name: str, value, rule: str) -> _Abort:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid {name} {shown}: expected {rule}")


# ------------------------------------------------------------------------- wiring and auth
class _Guard(grpc.aio.ServerInterceptor):
    """Checks the token and turns _Abort/unexpected errors into statuses, so no RPC crashes the server.

    The credential of the token presented (its SHA-256) is what the handlers see in _CALLER: a job
    belongs to the credential that created it. Without tokens (--insecure) it is "" for everyone."""

    def __init__(self, tokens: Sequence[str]):
        self._expected = [(f"Bearer {t}".encode(), credential_of(t)) for t in tokens]

    def _credential(self, metadata) -> Optional[str]:
        """The caller's credential, or None if it presented no accepted token."""
        if not self._expected:
            return ""
        got = dict(metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        found = None
        for expected, credential in self._expected:   # every entry, constant time each
            if hmac.compare_digest(got, expected) and found is None:
                found = credential
        return found

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        credential = self._credential(details.invocation_metadata)
        authorized = credential is not None
        parse = handler.request_deserializer
        # Requests arrive as bytes and are parsed here, so a corrupt message is answered with
        # INVALID_ARGUMENT naming the method instead of grpc's generic UNKNOWN.
        async def decode(raw, context):
            if not authorized:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
            try:
                return parse(raw)
            except Exception as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"malformed request to {details.method}: {e}")

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(raw, context):
                request = await decode(raw, context)
                _CALLER.set(credential)
                try:
                    return await inner(request, context)
                except _Abort as e:
                    await _abort(context, e)
                except (asyncio.CancelledError, aio.AbortError):
                    raise
                except Exception as e:  # a bug must not take the server down: answer INTERNAL
                    log.exception("%s failed", details.method)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream
        serialize = handler.response_serializer

        def serialize_or_pass(message):  # Watch may send pre-serialized WatchEvent bytes
            return message if isinstance(message, bytes) else serialize(message)

        async def stream(raw, context):
            request = await decode(raw, context)
            _CALLER.set(credential)
            try:
                await inner_stream(request, context)
            except _Abort as e:
                await _abort(context, e)
            except (asyncio.CancelledError, aio.AbortError):
                raise
            except Exception as e:
                log.exception("%s failed", details.method)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        return grpc.unary_stream_rpc_method_handler(stream, response_serializer=serialize_or_pass)


_DENIED = "missing or wrong token: send metadata 'authorization: Bearer <token>'"


async def _abort(context, e: _Abort):
    if e.leader:
        context.set_trailing_metadata((("leader", e.leader),))
    await context.abort(e.code, e.message)


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    # Ping every T/3 and wait T/3 for the ack: a worker stopped right after an ack is cut off by
    # 2T/3, so the heartbeat timeout T holds with a third to spare for scheduling delays.
    third_ms = int(config.heartbeat_timeout_s * 1000 / 3)
    return [
        ("grpc.keepalive_time_ms", third_ms),
        ("grpc.keepalive_timeout_ms", third_ms),
        # Measured with grpcio 1.85: keepalive_timeout_ms alone never closed the connection of a
        # SIGSTOPped client; the ping ack deadline that does is this one.
        ("grpc.http2.ping_timeout_ms", third_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        # Watch streams are idle between events; without this the server stops pinging after two
        # pings without data and a stopped worker would never be detected.
        ("grpc.http2.max_pings_without_data", 0),
        # Clients ping too (to notice a dead server): accept it instead of answering GOAWAY.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.max_receive_message_length", 1 << 20),
        ("grpc.so_reuseport", 0),
    ]


class RendezvousServer:
    """A running server: `await start()`, then `port`, then `await stop()`."""

    def __init__(self, config: ServerConfig, store: Optional[Store] = None):
        config.validate()
        self.config = config
        if store is None:
            if config.etcd_endpoints:
                from .store import EtcdStore
                store = EtcdStore(config.etcd_endpoints, access=config.etcd_access())
            else:
                store = MemoryStore()
        self.store = store
        self.service = RendezvousService(config, store)
        self.server: Optional[aio.Server] = None
        self.port = 0

    async def start(self) -> int:
        self.server = aio.server(interceptors=[_Guard(self.config.accepted_tokens())],
                                 options=server_options(self.config))
        pb_grpc.add_RendezvousServicer_to_server(self.service, self.server)
        addr = f"{self.config.host}:{self.config.port}"
        credentials = self.config.server_credentials()
        if credentials is not None:
            self.port = self.server.add_secure_port(addr, credentials)
        else:
            self.port = self.server.add_insecure_port(addr)
        if not self.port:
            raise OSError(f"cannot listen on {addr}")
        if not self.config.advertise_address:
            host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
            self.config.advertise_address = f"{host}:{self.port}"
            self.service.leadership.identity = (
                f"{self.config.replica_id}|{self.config.advertise_address}".encode())
        await self.server.start()
        self.service.start()
        return self.port

    async def wait_leader(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.service.is_leader:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.config.replica_id} not leader after {timeout_s} s")
            await asyncio.sleep(0.01)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.service.shutdown()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.store.close()
