"""The rendezvous gRPC service (grpc.aio): turns RPCs and stream breaks into decision events.

Shape: every job's membership lives in a `decision.JobState` value. An RPC or a liveness signal becomes
an event; `decision.decide` returns the next state and actions; the journal (journal.py) writes the
state to the store and only then are the actions sent on the workers' Watch streams. Because every
announced world is durable before anyone sees it, a restarted server or a new leader reloads the same
worlds and changes nothing; workers simply reattach their sessions.

The rest lives beside it in rendezvous/server/, each part given plain functions rather than this
service: tokens, credentials and session ids are auth.py's; the protobuf forms server_wire.py's
(and, for what both sides share, rendezvous/wire/messages.py's); what a delivered action is (for
the log, the event log, the counters and its recipients) description.py's; each job's Watch and
idle deadlines and its recovery clock liveness.py's; the time-driven changes job_timer.py's; the
rules of failure reports verdict.py's and carrying them out probes.py's; what is counted
(Prometheus) server_metrics.py's and what is recorded (the event log, each job's recent events
for Status) history.py's.

Liveness, measured (bench/rendezvous_scale.py, tests/rendezvous/test_server.py):
* A crashed worker's stream breaks at once (socket EOF/RST) and the grpc.aio handler is cancelled: we
  evict in milliseconds, well inside the 0.3 s budget with the settle window.
* A stopped or partitioned worker keeps its TCP connection, so the stream does not break. Python-level
  heartbeats would detect it, but they starve whenever training code holds the GIL (TorchElastic's
  own warning) and cost one RPC per worker per period. HTTP/2 keepalive pings are answered by gRPC's
  C core without the GIL, cost nothing in Python on either side, and a stopped process answers none:
  the server pings every heartbeat_timeout/3 and drops the connection when an ack is
  heartbeat_timeout/3 late (so a stopped worker is cut within 2/3 of the timeout), which cancels the
  stream and evicts the worker. So the open stream plus keepalive is the liveness signal; no RPC is
  a heartbeat (ReportProgress carries progress, AnswerProbe probe answers).
* A peer's ReportFailure is evidence, not a verdict (probes.py): a suspect whose stream is open is
  probed, and keepalive is trusted over a probe left unanswered.
* A worker must open its Watch within heartbeat_timeout of joining; until it has, it is not put into a
  world (it could not learn about it).
* After a leader change or restart nobody has a stream yet: each registered worker gets the reattach
  window (heartbeat timeout + leader lease TTL + client reconnect allowance) before it is evicted, and
  such evictions are not counted against its host.
* Commit steps (ReportProgress, Watch) are soft state: a client resends its step when it reattaches.

Who may do what (beyond auth.py's rules on tokens and sessions):
* A Join naming a registered worker must present its current session, or is refused (ALREADY_EXISTS)
  and the worker keeps it. ReportSuccess and ReportFailure count only from members of the world they
  name.
* A finished job refuses joins (FAILED_PRECONDITION, with its outcome in trailing metadata) for the
  reattach window, so every member learns how it ended; after that a Join without a previous
  session, by the same token, starts a new run under the id (new secret, new sessions).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import grpc
from grpc import aio

from rendezvous.server import auth, request_checks, server_wire
from rendezvous.wire import messages as wire
from rendezvous.server import decision as d
from rendezvous.server.server_config import ServerConfig
from rendezvous.server.collector import Collector
from rendezvous.server.description import Audience, describe
from rendezvous.server.fanout import AbortNotice
from rendezvous.common.event_log import EventLog
from rendezvous.server.history import RECENT_PER_JOB, History
from rendezvous.server.job_record import END, Job, Stream
from rendezvous.server.job_timer import JobTimers
from rendezvous.server.journal import Journal
from rendezvous.server.leader import Leadership
from rendezvous.server.liveness import Liveness
from rendezvous.server.server_metrics import ServerMetrics
from rendezvous.server.probes import FailureReports
from rendezvous.server.server_wire import RpcRefusal
from rendezvous.server.store import MemoryStore, Store, StoreError
from rendezvous.server.world_views import PendingView
from rendezvous.wire.messages import pb, pb_grpc

log = logging.getLogger("rendezvous.server.service")

RECONNECT_ALLOWANCE_S = 2.0   # client backoff tops out at 1 s (x1.5 jitter) plus one connect


class RendezvousService(pb_grpc.RendezvousServicer):
    def __init__(self, config: ServerConfig, store: Store, history: Optional[History] = None):
        self.config = config
        self.metrics = ServerMetrics(job_states=lambda: [j.state for j in list(self.jobs.values())],
                                     is_leader=lambda: self.is_leader,
                                     leadership_losses=lambda: self.leadership_losses)
        self.history = history if history is not None else History()
        store = self.metrics.metered(store)   # every store call the service makes is timed
        self.store = store
        self.jobs: dict[str, Job] = {}
        self.leadership = Leadership(store, f"{config.etcd_prefix}/leader",
                                     f"{config.replica_id}|{config.advertise_address}",
                                     config.leader_ttl_s, self._lost_leadership)
        self.journal = Journal(store, config.etcd_prefix, config.decision(),
                               fence=lambda: self.leadership.fence,
                               is_leader=lambda: self.is_leader, on_fenced=self._lost_leadership,
                               deliver=self._deliver)
        self._leading = False
        self.leading_since = 0.0              # monotonic: when this replica last became leader
        self.leadership_losses = 0
        self.stopping = False
        self._campaign: Optional[asyncio.Task] = None
        self._creating: dict[str, asyncio.Task] = {}
        self.reports = FailureReports(config.heartbeat_timeout_s,
                                      leading_since=lambda: self.leading_since,
                                      require_leader=self.require_leader, evict=self.evict,
                                      send=self.send, apply=self.journal.apply,
                                      wait_durable=self.journal.wait_durable,
                                      record=self.history.job)
        self.timers = JobTimers(self.journal.config, retention_s=config.finished_job_retention_s,
                                is_leader=lambda: self.is_leader, evict=self.evict,
                                retire=self.retire, apply=self.journal.apply)
        # Name lookups of ring addresses get threads of their own: a slow resolver must not hold
        # the default executor, where the store's calls (and the leader's lease refresh) run.
        self._resolver = request_checks.Resolver()
        self.collector = Collector(lambda: sum(len(j.state.workers) for j in self.jobs.values()))

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
        self.collector.start()

    async def _become_leader(self) -> None:
        await self.leadership.campaign()
        try:
            stored = await self.journal.load()
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
        now, timeout = time.time(), self.config.heartbeat_timeout_s
        self.jobs = {}
        for state, revision in stored:
            liveness = (Liveness(timeout) if state.phase in d.TERMINAL else
                        Liveness.after_leader_change(timeout, state.workers, now, window))
            job = Job(state=state, revision=revision, liveness=liveness, durable_state=state)
            self.jobs[state.job_id] = job
            self.timers.start(job)
        self._leading = True
        self.leading_since = time.monotonic()
        self.metrics.elected()
        self.history.server("leader_elected", replica_id=self.config.replica_id, jobs=len(self.jobs))
        log.info("replica %s is the leader (%d job(s) loaded; workers have %.1f s to reattach)",
                 self.config.replica_id, len(self.jobs), window)

    def _lost_leadership(self, reason: str) -> None:
        """Stop acting as leader at once: end every stream (clients go to the next leader)."""
        if not self._leading:
            return
        log.warning("replica %s lost leadership: %s", self.config.replica_id, reason)
        self.history.server("leadership_lost", replica_id=self.config.replica_id, reason=reason)
        self.leadership_losses += 1
        self._leading = False
        self.leadership.drop()
        for job in self.jobs.values():
            if job.timer:
                job.timer.cancel()
            job.fanout.close()
            for stream in job.streams.values():
                stream.closed_by_server = True   # the client reconnects to the new leader
                stream.queue.put_nowait(END)
            for _, fut in job.probes.values():
                fut.cancel()
        self.jobs = {}
        self.history.forget()   # the next leader's owners of these ids must not see them
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
            job.fanout.close()
            for stream in job.streams.values():
                stream.closed_by_server = True
                stream.queue.put_nowait(END)
        # Let pending group commits land before the lease goes.
        for job in self.jobs.values():
            if job.seq > job.durable_seq:
                try:
                    await asyncio.wait_for(self.journal.wait_durable(job, job.seq), 2.0)
                except Exception:
                    pass
        self._leading = False
        await self.leadership.resign()
        self._resolver.shutdown()
        self.collector.stop()

    async def _leader_hint(self) -> str:
        try:
            # Bounded: this replica may be the one whose store connection stalls.
            current = await asyncio.wait_for(self.leadership.current_leader(), 0.5)
        except (StoreError, asyncio.TimeoutError):
            return ""
        return current.split("|", 1)[1] if current and "|" in current else ""

    async def require_leader(self) -> None:
        if self.stopping:
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, "server is shutting down; try another address")
        if not self.is_leader:
            hint = await self._leader_hint()
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE,
                              f"replica {self.config.replica_id} is not the rendezvous leader"
                              + (f"; the leader is at {hint}" if hint else "; no leader elected yet"),
                              leader=hint)

    # -------------------------------------------------------------------------- state changes
    def send(self, job: Job, worker_id: str, event) -> None:
        job.fanout.send(((worker_id, event),))

    def _deliver(self, job: Job, action: d.Action, before: d.JobState) -> None:
        """Carry out a durable action (the journal calls it): logged, counted and recorded when it
        takes effect (durable, sent), not when decided; then sent to those its description names."""
        what = describe(action, before.world_version)
        log.info("job %s: %s", job.state.job_id, what.summary)
        recovery_s = job.liveness.world_announced(time.monotonic()) if what.world_announced else None
        self.metrics.delivered(what, recovery_s)
        self.history.delivered(job.state, what)
        if what.audience is Audience.NEW_WORLD:
            job.fanout.send(job.views(action.world_version, action.members).pending(job.streams))
            now = time.time()
            job.fanout.send((w, server_wire.standby_event(action.world_version, server_wire.standby_reason(
                job.state, w, now))) for w in action.standby)
        elif what.audience is Audience.WORLD_BEFORE:   # one notice, serialized once
            event = server_wire.notice_event(action)
            notice = AbortNotice(event.abort) if event.HasField("abort") else event.SerializeToString()
            job.fanout.send(((m.worker_id, notice) for m in before.world), paced=True)
        elif what.audience is Audience.DROPPED:
            # (Its Watch deadline stays: after a rejoin it is the new session's; a stale one finds
            # nobody to evict.)
            stream = job.streams.pop(action.worker_id, None)
            if stream is not None:
                stream.closed_by_server = True
                stream.queue.put_nowait(RpcRefusal(grpc.StatusCode.NOT_FOUND,
                                                    f"session ended: {action.reason}"))
                self._stream_gone(job)
        elif what.audience is Audience.EVERYONE:
            event = server_wire.finished_event(action.succeeded, action.reason)
            for stream in job.streams.values():
                stream.closed_by_server = True
                stream.queue.put_nowait(event)
                stream.queue.put_nowait(END)
            job.streams.clear()

    def _stream_gone(self, job: Job) -> None:
        """A stream left `job.streams`: the last one going starts the idle clock."""
        if not job.streams and job.liveness.streams_gone(time.time()):
            job.wake.set()

    async def retire(self, job: Job, why: str) -> bool:
        """Remove the job from the store and from memory; False if the store failed (try later).

        RPCs that find the job meanwhile are answered UNAVAILABLE (they retry, and then find no
        job)."""
        job_id = job.state.job_id
        if self.jobs.get(job_id) is not job:
            return True
        job.closing = True
        try:
            gone = await self.journal.delete(job)
        except (StoreError, RpcRefusal) as e:  # the next leader retries when it loads the job
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
            self.history.forget(job_id)
        log.info("job %s: %s", job_id, why)
        return True

    def evict(self, job: Job, worker_id: str, reason: str, count_failure: bool = True,
              cause: d.Departure = d.Departure.FAILED) -> int:
        """Evict `worker_id` if it is still registered; returns the change's seq to wait for."""
        w = job.state.workers.get(worker_id)
        if w is not None:
            job.liveness.failure_signal(time.monotonic(), job.state, worker_id)
            self.journal.apply(job, d.Evict(worker_id, f"worker {worker_id} on host {w.host} evicted: "
                                                       f"{reason}", count_failure, cause))
        return job.seq

    # ------------------------------------------------------------------------------- lookups
    def _job(self, job_id: str) -> Optional[Job]:
        """The caller's job of that id; None when there is none or it belongs to another token."""
        job = self.jobs.get(job_id)
        if job is None or not auth.owns(job.state, auth.caller()):
            return None
        if job.closing:
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, f"job {job_id} is being removed or "
                                                           f"replaced; retry")
        return job

    def _by_session(self, sid: str) -> tuple[Job, d.Worker]:
        """The job and the worker whose current session `sid` is; refuses any other id."""
        parsed = auth.parse_session(sid)
        if parsed is None:
            # Not echoed: it may be a real session id, mangled.
            raise RpcRefusal(grpc.StatusCode.INVALID_ARGUMENT,
                              "malformed session_id: expected the session_id a Join returned")
        job_id, run, worker_id, secret = parsed
        job = self._job(job_id)
        if job is None:
            raise RpcRefusal(grpc.StatusCode.NOT_FOUND, f"unknown job {job_id!r}: join again")
        w = job.state.workers.get(worker_id)
        if not auth.holds_session(w, secret) or run != job.state.run:
            if job.state.phase in d.TERMINAL:
                raise RpcRefusal(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"job {job_id} finished ({job.state.phase.value}: {job.state.reason})",
                                  finished=server_wire.outcome(job.state.phase))
            raise RpcRefusal(grpc.StatusCode.NOT_FOUND,
                              f"job {job_id}: not a current session of worker {worker_id} (evicted, "
                              f"left, rejoined, or never issued): join again")
        return job, w

    # ---------------------------------------------------------------------------------- RPCs
    async def Join(self, request, context):
        await self.require_leader()
        request_checks.check_id("job_id", request.job_id)
        request_checks.check_id("worker_id", request.worker_id)
        request_checks.check_host(request.host)
        request_checks.check_step(request.commit_step)
        spec = request.spec
        for name, timeout in (("spec", spec.elastic_timeout_s),
                              ("spec_if_new", request.spec_if_new.elastic_timeout_s)):
            if timeout != timeout or timeout < 0 or timeout > 7 * 86400:  # NaN or out of range
                raise request_checks.bad(f"{name}.elastic_timeout_s", timeout,
                                         "0..604800 (0: server default)")
        previous = None   # (run, secret) of the session this worker says it had
        if request.session_id:
            parsed = auth.parse_session(request.session_id)
            if parsed is None or parsed[0] != request.job_id or parsed[2] != request.worker_id:
                raise RpcRefusal(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"invalid session_id: expected a session of worker {request.worker_id}"
                                  f" in job {request.job_id} as a Join returned it, or none")
            previous = parsed[1], parsed[3]
        caller = auth.caller()
        job = self.jobs.get(request.job_id)
        if job is not None and not auth.owns(job.state, caller):
            raise RpcRefusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"job {request.job_id} belongs to another token: this one cannot join it")
        await request_checks.check_ring_address(request.ring_address, self._resolver, caller)
        if job is not None and job.closing:
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, f"job {request.job_id} is being removed or "
                                                           f"replaced; retry")
        relaunch = (job is not None and job.state.phase in d.TERMINAL and previous is None
                    and time.time() >= (job.state.finished_at or 0.0) + self.reattach_window_s())
        if job is None or relaunch:
            creating = d.join_spec(request.job_id, wire.spec_from_pb(spec),
                                   wire.spec_from_pb(request.spec_if_new), None)
            job = await self._create_job(request.job_id, self._new_spec(request.job_id, creating), caller,
                                         replacing=job)
            if not auth.owns(job.state, caller):  # a concurrent creation won
                raise RpcRefusal(grpc.StatusCode.PERMISSION_DENIED,
                                  f"job {request.job_id} belongs to another token: this one cannot "
                                  f"join it")
        elif job.state.phase not in d.TERMINAL:
            if not job.state.ring_secret or not job.state.run:
                raise RpcRefusal(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"job {request.job_id} was created by an older server, without a "
                                  f"ring secret: no worker can join it; launch it under another id")
            settled = d.join_spec(request.job_id, wire.spec_from_pb(spec), d.JobSpec(0, 0, 0.0),
                                  job.state.spec)
            if isinstance(settled, d.SpecConflict):
                raise RpcRefusal(grpc.StatusCode.FAILED_PRECONDITION, settled.reason)
            if previous is not None and previous[0] != job.state.run:
                # Its run ended and the id was launched again: state it kept from the old run must
                # not become this run's (it could hold the highest step and be synced to all).
                raise RpcRefusal(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"job {request.job_id}: the run that worker {request.worker_id}'s "
                                  f"session belonged to is over and a new run started; it cannot rejoin")
            if (request.worker_id not in job.state.workers
                    and len(job.state.workers) >= self.config.max_workers_per_job):
                raise RpcRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"job {request.job_id} already has {len(job.state.workers)} workers")
        sid, session_hash = auth.new_session(job.state, request.worker_id)
        proof = auth.session_hash(previous[1]) if previous is not None else ""
        seq, actions = self.journal.apply(job, d.Join(request.worker_id, request.host,
                                                      request.ring_address, request.commit_step,
                                                      attached=False, session_hash=session_hash,
                                                      proof=proof))
        for a in actions:
            if isinstance(a, d.Rejected):
                raise server_wire.refusal(a, f"job {request.job_id}: worker {request.worker_id} "
                                             f"refused: {a.reason}", job.state.phase)
        # It must open its Watch within the heartbeat timeout; until then it is kept out of worlds.
        job.liveness.joined(request.worker_id, time.time())
        job.wake.set()
        await self.journal.wait_durable(job, seq)
        self.history.job(job.state, "worker_joined", worker_id=request.worker_id,
                         host=request.host, rejoin=previous is not None,
                         detail=f"on host {request.host}")
        return pb.JoinResponse(session_id=sid, world_version=job.state.world_version,
                               spec=wire.spec_pb(job.state.spec),
                               ring_secret=bytes.fromhex(job.state.ring_secret))

    def _new_spec(self, job_id: str, asked: d.JobSpec) -> d.JobSpec:
        """The spec of a job this Join creates (`d.join_spec` of the request), its unset limits
        filled in; refuses bad limits and a full server."""
        cap = self.config.max_workers_per_job
        resolved = asked.resolved(cap, self.config.default_elastic_timeout_s)
        if asked.min_np < 1 or resolved.max_np < asked.min_np or resolved.max_np > cap:
            raise RpcRefusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"job {job_id}: spec needs 1 <= min_np <= max_np <= {cap} (max_np 0: "
                              f"{cap}), got min_np={asked.min_np} max_np={asked.max_np} (spec, and "
                              f"spec_if_new where spec leaves them 0)")
        running = sum(1 for j in self.jobs.values() if j.state.phase not in d.TERMINAL)
        if running >= self.config.max_jobs:
            raise RpcRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"server runs {running} jobs, the limit")
        return resolved

    async def _create_job(self, job_id: str, spec: d.JobSpec, credential: str,
                          replacing: Optional[Job] = None) -> Job:
        # Concurrent first joins of one job share a single creation.
        creating = self._creating.get(job_id)
        if creating is None:
            creating = asyncio.get_running_loop().create_task(
                self._create_job_once(job_id, spec, credential, replacing))
            self._creating[job_id] = creating
            creating.add_done_callback(lambda _: self._creating.pop(job_id, None))
        return await asyncio.shield(creating)

    async def _create_job_once(self, job_id: str, spec: d.JobSpec, credential: str,
                               replacing: Optional[Job]) -> Job:
        """Create the job, or a new run of a finished one (`replacing`), with a fresh ring secret."""
        if replacing is not None:
            await self.journal.wait_durable(replacing, replacing.seq)   # finished: nothing changes after
            replacing.closing = True
            if replacing.timer:
                replacing.timer.cancel()
        state = d.new_job(job_id, spec, time.time(), credential=credential,
                          ring_secret=auth.new_ring_secret(), run=auth.new_run())
        try:
            rev = await self.journal.create(state, replacing.revision if replacing is not None else 0)
        except RpcRefusal:
            if replacing is not None and self.jobs.get(job_id) is replacing:
                replacing.closing = False
                self.timers.start(replacing)   # it is still the job: it must still be forgotten
            raise
        if rev is None:  # only the leader creates jobs: someone else leads, or wrote it
            self._lost_leadership(f"fenced create of job {job_id} refused")
            await self.require_leader()
        if not self.is_leader:
            await self.require_leader()
        job = Job(state=state, revision=rev, durable_state=state,
                  liveness=Liveness.of_new_job(self.config.heartbeat_timeout_s, time.time()))
        self.jobs[job_id] = job
        self.timers.start(job)
        self.history.job(job.state, "job_created", min_np=spec.min_np, max_np=spec.max_np,
                         detail=f"np {spec.min_np}..{spec.max_np}")
        if replacing is not None:
            log.info("job %s: launched again (the previous run %s)", job_id,
                     replacing.state.phase.value)
        return job

    async def Watch(self, request, context):
        await self.require_leader()
        job, w = self._by_session(request.session_id)
        old = job.streams.get(w.worker_id)
        if old is not None:  # the worker reconnected before we noticed the old stream break
            old.closed_by_server = True
            old.queue.put_nowait(RpcRefusal(grpc.StatusCode.CANCELLED, "replaced by a newer Watch"))
        stream = Stream()
        try:
            await self._watch(job, w, request, context, stream)
        finally:
            stream.ended.set()

    async def _watch(self, job: Job, w: d.Worker, request, context, stream: Stream) -> None:
        job.streams[w.worker_id] = stream
        job.liveness.watch_opened(w.worker_id)
        job.attached.set()               # wakes reports waiting for this worker to reattach
        job.attached = asyncio.Event()
        if not w.attached:
            self.journal.apply(job, d.Attach(w.worker_id))
        if request.commit_step > w.commit_step:   # resent on reattach: progress is soft state
            self.journal.apply(job, d.Progress(w.worker_id, request.commit_step))
        # The snapshot is the last *stored* state: what is only in memory may still be lost (if the
        # write fails and another replica takes over); later changes follow through the outbox.
        state = job.durable_state if job.durable_state is not None else job.state
        views = job.views(state.world_version, state.world)
        for event in server_wire.snapshot(state, views, w.worker_id, time.time()):
            await context.write(event)
        if state.phase in d.TERMINAL:
            job.streams.pop(w.worker_id, None)
            return
        try:
            while True:
                item = await stream.queue.get()
                if item is END:
                    return
                if isinstance(item, RpcRefusal):
                    await auth.abort(context, item)
                await context.write(item.serialized() if isinstance(item, (PendingView, AbortNotice)) else item)
        finally:
            # Reached on a broken stream (client crashed, keepalive failed: the handler is
            # cancelled) and on server-side closes; only the former is the worker's failure.
            if not stream.closed_by_server and not self.stopping and self.is_leader:
                if job.streams.get(w.worker_id) is stream:
                    del job.streams[w.worker_id]
                    self._stream_gone(job)
                    cur = job.state.workers.get(w.worker_id)
                    if cur is not None and cur.join_seq == w.join_seq:
                        self.evict(job, w.worker_id, "watch stream broken",
                                   cause=d.Departure.STREAM_BROKEN)

    async def ReportProgress(self, request, context):
        await self.require_leader()
        request_checks.check_step(request.commit_step)
        if request.HasField("straggler"):
            request_checks.check_straggler(request.straggler.score)
        request_checks.check_step(request.step, "step")
        job, w = self._by_session(request.session_id)
        if request.commit_step > w.commit_step:
            self.journal.apply(job, d.Progress(w.worker_id, request.commit_step))
        if job.state.member(w.worker_id) is not None:   # a world it steps in is one it is in (or was)
            job.progress[w.worker_id] = (min(request.stepped_world, job.state.world_version), request.step)
        spare = 0
        if request.HasField("straggler"):   # its pace: soft state (pace.py)
            spare = job.stragglers.heard(job.state, w, wire.straggler_from_pb(request.straggler), time.time(),
                                         record=self.history.job)
        return pb.ReportProgressResponse(world_version=job.state.world_version, spares=spare)

    async def AnswerProbe(self, request, context):
        await self.require_leader()
        job, w = self._by_session(request.session_id)
        probed, fut = job.probes.get(request.nonce, (None, None))
        # Only the probed worker's own session proves it alive: another member answering for it
        # would keep a dead peer in the world.
        if fut is not None and probed == w.worker_id and not fut.done():
            fut.set_result(w.worker_id)
        return pb.AnswerProbeResponse()

    async def AcknowledgeAbort(self, request, context):
        await self.require_leader()
        job, w = self._by_session(request.session_id)
        self.journal.apply(job, d.AbortAck(w.worker_id, request.world_version))
        return pb.AcknowledgeAbortResponse()

    async def Leave(self, request, context):
        await self.require_leader()
        job, w = self._by_session(request.session_id)
        seq, _ = self.journal.apply(job, d.Leave(w.worker_id, straggler=request.straggler))
        await self.journal.wait_durable(job, seq)
        return pb.LeaveResponse()

    async def ReportFailure(self, request, context):
        await self.require_leader()
        by_rank = not request.suspect_worker_id and request.HasField("suspect_rank")
        if not by_rank:
            request_checks.check_id("suspect_worker_id", request.suspect_worker_id)
        if len(request.reason) > request_checks.MAX_REASON:
            raise request_checks.bad("reason", f"<{len(request.reason)} chars>",
                             f"at most {request_checks.MAX_REASON} chars")
        job, reporter = self._by_session(request.session_id)
        if by_rank:   # the reporter's view named no worker for that rank: the world's member of it
            world = job.state.world
            if request.world_version != job.state.world_version or request.suspect_rank >= len(world):
                return pb.ReportFailureResponse(evicted=False, detail=f"stale report: rank {request.suspect_rank} "
                                                f"of world {request.world_version} is not in the current world "
                                                f"{job.state.world_version}")
            request.suspect_worker_id = world[request.suspect_rank].worker_id
        return await self.reports.judge(job, reporter, request)

    async def ReportSuccess(self, request, context):
        await self.require_leader()
        job, w = self._by_session(request.session_id)
        seq, actions = self.journal.apply(job, d.Success(w.worker_id, request.world_version, request.commit_step))
        for a in actions:
            if isinstance(a, d.Rejected):
                raise server_wire.refusal(a, a.reason, job.state.phase)
        await self.journal.wait_durable(job, seq)
        return pb.ReportSuccessResponse(finished=any(isinstance(a, d.AnnounceFinished) for a in actions))

    async def Status(self, request, context):
        if request.job_id:
            request_checks.check_id("job_id", request.job_id)
        n_events = min(request.events, RECENT_PER_JOB)
        now = time.time()
        if self.is_leader:
            jobs = {j: (job.state, set(job.streams), job.stragglers.current(job.state), dict(job.progress))
                    for j, job in self.jobs.items()}
        else:  # all state is in the store: a follower can answer too (nobody is attached to it)
            try:
                stored = await self.journal.load()
            except StoreError as e:
                raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, str(e))
            jobs = {state.job_id: (state, set(), {}, {}) for state, _ in stored}
        # Only the caller's own jobs: another token's jobs are not even named.
        caller = auth.caller()
        out = pb.StatusResponse(leader_id=self.config.replica_id if self.is_leader else "")
        for job_id in sorted(j for j, v in jobs.items() if auth.owns(v[0], caller) and request.job_id in ("", j)):
            state, attached, stragglers, progress = jobs[job_id]
            js = server_wire.job_status(state, attached, now, stragglers, progress, request.members_from,
                                        request.max_members)
            js.events.extend(server_wire.job_event_pb(e) for e in
                             self.history.recent(job_id, state.credential, n_events))
            out.jobs.append(js)
        if request.job_id and not out.jobs:
            raise RpcRefusal(grpc.StatusCode.NOT_FOUND, f"unknown job {request.job_id!r}")
        return out


class RendezvousServer:
    """A running server: `await start()`, then `port`, then `await stop()`."""

    def __init__(self, config: ServerConfig, store: Optional[Store] = None,
                 events: Optional[EventLog] = None):
        config.validate()
        self.config = config
        if store is None:
            if config.etcd_endpoints:
                from rendezvous.server.store import EtcdStore
                store = EtcdStore(config.etcd_endpoints, access=config.etcd_access())
            else:
                store = MemoryStore()
        self.store = store
        self.history = History(events if events is not None else EventLog(config.events_path))
        self.service = RendezvousService(config, store, self.history)
        self.server: Optional[aio.Server] = None
        self.port = 0
        self.metrics_port: Optional[int] = None

    async def start(self) -> int:
        self.server = aio.server(interceptors=[self.service.metrics.interceptor(),
                                               auth.Guard(self.config.accepted_tokens())],
                                 options=self.config.grpc_options())
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
        if self.config.metrics_port is not None:
            self.metrics_port = self.service.metrics.serve(self.config.metrics_host,
                                                           self.config.metrics_port)
        await self.server.start()
        self.history.server("server_started", replica_id=self.config.replica_id,
                            address=self.config.advertise_address, metrics_port=self.metrics_port,
                            store="memory" if isinstance(self.store, MemoryStore) else "etcd")
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
        self.service.metrics.stop()
        self.history.server("server_stopped", replica_id=self.config.replica_id)
        self.history.close()
