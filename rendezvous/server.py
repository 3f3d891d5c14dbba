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
* A peer's ReportFailure evicts at once only a suspect without a stream. A suspect with a stream is
  probed; if its (Python) client does not answer, e.g. because training code holds the GIL, we trust
  keepalive: the report waits up to the heartbeat timeout for the stream to break, and evicts nobody
  while the connection stays alive.
* A worker must open its Watch within heartbeat_timeout of joining; until it has, it is not put into a
  world (it could not learn about it).
* After a leader change or restart nobody has a stream yet: each registered worker gets the reattach
  window (heartbeat timeout + leader lease TTL + client reconnect allowance) before it is evicted, and
  such evictions are not counted against its host.
* Committed steps (Heartbeat, Watch) are soft state: they update the in-memory job state and ride along
  with the next real change that is written; a client resends its step when it reattaches.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc
from grpc import aio

from . import decision as d
from ._proto import rendezvous_pb2 as pb
from ._proto import rendezvous_pb2_grpc as pb_grpc
from .config import ServerConfig
from .leader import Leadership
from .store import MemoryStore, Store, StoreError

log = logging.getLogger("rendezvous.server")

# Used with fullmatch: `$` in re.match would also accept a trailing newline.
ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
HOST_RE = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}")
ADDR_RE = re.compile(r"[A-Za-z0-9._\-\[\]:]{1,255}:[0-9]{1,5}")
SEQ_RE = re.compile(r"[0-9]{1,18}")
RECONNECT_ALLOWANCE_S = 2.0   # client backoff tops out at 1 s (x1.5 jitter) plus one connect
MAX_REASON = 1024
_END = object()


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


def session_id(job_id: str, worker_id: str, seq: int) -> str:
    # Derived from the durable state (job, worker, join sequence), so sessions survive a restart
    # without storing anything extra.
    return f"{job_id}/{worker_id}/{seq}"


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
        self.leadership_losses = 0
        self.stopping = False
        self._campaign: Optional[asyncio.Task] = None
        self._creating: dict[str, asyncio.Task] = {}
        self._nonce = int(time.time() * 1000) << 16

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
            self.jobs[state.job_id] = job
            self._start_timer(job)
        self._leading = True
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

    async def _timer(self, job: _Job) -> None:
        """Fires settle windows, elastic timeouts, reattach deadlines and probe deadlines."""
        while job.state.phase not in d.TERMINAL:
            deadlines = [t for t in [d.next_deadline(job.state, self.dcfg),
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
            due = d.next_deadline(job.state, self.dcfg)
            if due is not None and due <= now:
                self._apply(job, d.Tick())
        await self._forget_when_expired(job)

    async def _forget_when_expired(self, job: _Job) -> None:
        """Keep a finished job (for status, and to refuse late joiners) for a while, then drop it."""
        job_id = job.state.job_id
        finished_at = job.state.finished_at if job.state.finished_at is not None else time.time()
        await asyncio.sleep(max(0.0, finished_at + self.config.finished_job_retention_s - time.time()))
        if job.seq > job.durable_seq:
            await self._wait_durable(job, job.seq)
        try:
            await self.store.delete(f"{self.config.etcd_prefix}/jobs/{job_id}",
                                    fence=self.leadership.fence)
        except StoreError as e:  # the next leader retries when it loads the job
            log.warning("job %s: forgetting the finished job failed: %s", job_id, e)
            return
        if self.jobs.get(job_id) is job:
            del self.jobs[job_id]
            log.info("job %s: finished %.0f s ago, forgotten", job_id,
                     self.config.finished_job_retention_s)

    def _evict(self, job: _Job, worker_id: str, reason: str, count_failure: bool = True) -> None:
        w = job.state.workers.get(worker_id)
        if w is None:
            return
        self._apply(job, d.Evict(worker_id, f"worker {worker_id} on host {w.host} evicted: {reason}",
                                 count_failure))

    # ------------------------------------------------------------------------------- lookups
    def _session(self, sid: str) -> tuple[_Job, d.Worker]:
        parts = sid.split("/")
        if len(sid) > 400 or len(parts) != 3 or not SEQ_RE.fullmatch(parts[2]):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed session_id {sid[:80]!r}")
        job_id, worker_id, seq = parts[0], parts[1], int(parts[2])
        job = self.jobs.get(job_id)
        if job is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job_id!r}: join again")
        w = job.state.workers.get(worker_id)
        if w is None or w.join_seq != seq:
            if job.state.phase in d.TERMINAL:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {job_id} finished ({job.state.phase.value}: {job.state.reason})")
            raise _Abort(grpc.StatusCode.NOT_FOUND,
                         f"session {sid} ended (worker {worker_id} evicted, left or rejoined): "
                         f"join again")
        return job, w

    # ---------------------------------------------------------------------------------- RPCs
    async def Join(self, request, context):
        await self._require_leader()
        _check_id("job_id", request.job_id)
        _check_id("worker_id", request.worker_id)
        if not HOST_RE.fullmatch(request.host):
            raise _bad("host", request.host, "1..255 chars of [A-Za-z0-9._:[]-]")
        if not ADDR_RE.fullmatch(request.ring_address) or not 0 < int(
                request.ring_address.rsplit(":", 1)[1]) < 65536:
            raise _bad("ring_address", request.ring_address, "HOST:PORT with port 1..65535")
        if request.committed_step < -1:
            raise _bad("committed_step", request.committed_step, ">= -1")
        spec = request.spec
        timeout = spec.elastic_timeout_s
        if timeout != timeout or timeout < 0 or timeout > 7 * 86400:  # NaN or out of range
            raise _bad("spec.elastic_timeout_s", timeout, "0..604800 (0: server default)")
        job = self.jobs.get(request.job_id)
        if job is None:
            if spec.min_np < 1 or spec.max_np < spec.min_np or spec.max_np > self.config.max_workers_per_job:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"job {request.job_id}: spec needs 1 <= min_np <= max_np <= "
                             f"{self.config.max_workers_per_job}, got min_np={spec.min_np} "
                             f"max_np={spec.max_np}")
            running = sum(1 for j in self.jobs.values() if j.state.phase not in d.TERMINAL)
            if running >= self.config.max_jobs:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"server runs {running} jobs, the limit")
            job_spec = d.JobSpec(spec.min_np, spec.max_np,
                                 timeout or self.config.default_elastic_timeout_s)
            job = await self._create_job(request.job_id, job_spec)
        else:
            have = job.state.spec
            if (spec.min_np and spec.min_np != have.min_np) or (spec.max_np and spec.max_np != have.max_np):
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {request.job_id} has min_np={have.min_np} max_np={have.max_np}; "
                             f"this join asks for min_np={spec.min_np} max_np={spec.max_np}")
            if (request.worker_id not in job.state.workers
                    and len(job.state.workers) >= self.config.max_workers_per_job):
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"job {request.job_id} already has {len(job.state.workers)} workers")
        seq, actions = self._apply(job, d.Join(request.worker_id, request.host,
                                                request.ring_address, request.committed_step,
                                                attached=False))
        for a in actions:
            if isinstance(a, d.Rejected):
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                             f"job {request.job_id}: worker {request.worker_id} refused: {a.reason}")
        # It must open its Watch within the heartbeat timeout; until then it is kept out of worlds.
        job.attach_deadline[request.worker_id] = (
            time.time() + self.config.heartbeat_timeout_s,
            f"did not open its watch stream within {self.config.heartbeat_timeout_s:g} s of joining")
        job.wake.set()
        await self._wait_durable(job, seq)
        w = job.state.workers[request.worker_id]
        s = job.state.spec
        return pb.JoinResponse(session_id=session_id(request.job_id, w.worker_id, w.join_seq),
                               world_version=job.state.version,
                               spec=pb.JobSpec(min_np=s.min_np, max_np=s.max_np,
                                               elastic_timeout_s=s.elastic_timeout_s))

    async def _create_job(self, job_id: str, spec: d.JobSpec) -> _Job:
        # Concurrent first joins of one job share a single creation.
        creating = self._creating.get(job_id)
        if creating is None:
            creating = asyncio.get_running_loop().create_task(self._create_job_once(job_id, spec))
            self._creating[job_id] = creating
            creating.add_done_callback(lambda _: self._creating.pop(job_id, None))
        return await asyncio.shield(creating)

    async def _create_job_once(self, job_id: str, spec: d.JobSpec) -> _Job:
        state = d.new_job(job_id, spec, time.time())
        key = f"{self.config.etcd_prefix}/jobs/{job_id}"
        data = d.to_json(state)
        try:
            rev = await self.store.put(key, data, expected_revision=0, fence=self.leadership.fence)
        except StoreError as e:
            # Ambiguous: it may have landed. Re-read once; otherwise the client retries the Join.
            try:
                cur = await self.store.get(key)
            except StoreError:
                cur = None
            if cur is None or cur.value != data:
                raise _Abort(grpc.StatusCode.UNAVAILABLE, f"job {job_id}: cannot create it in the "
                                                          f"store ({e}); retry") from None
            rev = cur.revision
        if rev is None:  # only the leader creates jobs: someone else leads, or wrote it
            self._lost_leadership(f"fenced create of job {job_id} refused")
            await self._require_leader()
        if not self.is_leader:
            await self._require_leader()
        job = _Job(state=state, revision=rev, durable_state=state)
        self.jobs[job_id] = job
        self._start_timer(job)
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
        suspect = request.suspect_worker_id
        if suspect not in state.workers:
            return pb.ReportFailureResponse(evicted=False, detail=f"{suspect} is not registered "
                                                                  f"(already evicted or left)")
        why = f"reported by {reporter.worker_id}: {request.reason or 'unreachable'}"
        if request.unusable_address and state.in_world(reporter.worker_id) and state.in_world(suspect):
            # A probe answer would prove only that the suspect lives, not that its ring
            # address leads anywhere: alive or not, no ring of this job can include it.
            seq, _ = self._apply_evict(job, suspect, f"unusable ring address; {why}")
            await self._wait_durable(job, seq)
            return pb.ReportFailureResponse(evicted=True, detail="suspect's ring address is unusable")
        if suspect not in job.streams:
            seq, _ = self._apply_evict(job, suspect, f"no watch stream; {why}")
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
                cur = job.state.workers.get(suspect)
                if cur is None or cur.join_seq != state.workers[suspect].join_seq:
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

    async def _ring_broken(self, job: _Job, reporter_id: str, version: int, why: str) -> None:
        # Nobody is evicted, but the reporter's ring is broken: without a new version every
        # member would wait for a world that never comes.
        seq, _ = self._apply(job, d.RingBroken(reporter_id, version, f"ring of world {version} broken, "
                                                                      f"every member alive ({why})"))
        await self._wait_durable(job, seq)

    def _apply_evict(self, job: _Job, worker_id: str, reason: str):
        self._evict(job, worker_id, reason)
        return job.seq, []

    async def ReportSuccess(self, request, context):
        await self._require_leader()
        job, w = self._session(request.session_id)
        seq, _ = self._apply(job, d.Success(w.worker_id))
        await self._wait_durable(job, seq)
        return pb.ReportSuccessResponse()

    async def Status(self, request, context):
        if request.job_id:
            _check_id("job_id", request.job_id)
        now = time.time()
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
    """Checks the token and turns _Abort/unexpected errors into statuses, so no RPC crashes the server."""

    def __init__(self, token: Optional[str]):
        self._expected = f"Bearer {token}".encode() if token else None

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        authorized = True
        if self._expected is not None:
            got = dict(details.invocation_metadata or ()).get("authorization", "")
            got = got.encode() if isinstance(got, str) else got
            authorized = hmac.compare_digest(got, self._expected)
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
                store = EtcdStore(config.etcd_endpoints)
            else:
                store = MemoryStore()
        self.store = store
        self.service = RendezvousService(config, store)
        self.server: Optional[aio.Server] = None
        self.port = 0

    async def start(self) -> int:
        self.server = aio.server(interceptors=[_Guard(self.config.token)],
                                 options=server_options(self.config))
        pb_grpc.add_RendezvousServicer_to_server(self.service, self.server)
        addr = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert:
            with open(self.config.tls_cert, "rb") as f:
                cert = f.read()
            with open(self.config.tls_key, "rb") as f:
                key = f.read()
            self.port = self.server.add_secure_port(addr, grpc.ssl_server_credentials([(key, cert)]))
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
