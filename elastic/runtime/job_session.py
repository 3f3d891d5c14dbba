"""A worker's session joined to its job: join, follow the announced worlds, form their rings, run the loop, leave.

``JobSession`` adds membership to the step protocol of ``elastic.runtime.session`` (whose module doc
describes the protocol): it holds the ring listener and the rendezvous client, forms the ring of
each world that includes this worker, and runs ``elastic.run``'s loop, carrying out the recovery
plan ``elastic.runtime.reaction.after_error`` makes of each error. Its pump thread reads the
rendezvous events and carries out what ``reaction.react`` decides they mean (abort the ring in
flight, record a pending change), so a collective stuck on a stopped peer fails within
milliseconds of the announcement.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple, Union

from rendezvous.client.watch_events import Ended, WorldInfo
from rendezvous.client.worker_client import RendezvousClient
from rendezvous.common.channel import RendezvousCallAbandoned
from rendezvous.common.channel import RendezvousRPCError as _ClientError
from rendezvous.wire.membership import Blame, JobSpec

from elastic.ring.arrival import Arrival
from elastic.ring.communicator import Communicator, Listener
from elastic.ring.errors import (BadPeerError, CollectiveMismatchError, ElasticError, ErrorKind, HandshakeError,
                                 SettingsMismatchError, WorkerLostError)
from elastic.ring.ring_view import RingView
from elastic.runtime import fork_guard, preemption, reaction, straggler_detector, world_env, worker_metrics
from elastic.runtime.commit_watch import describe_commit, joiner_note_after, joiner_waits, training_step
from elastic.runtime.errors import (ElasticTimeout, EvictedAsStraggler, LeaveRequested, LeftJob, MembershipChanged,
                                    Outvoted, Preempted, RendezvousError)
from elastic.runtime.hooks import WorldChange
from elastic.runtime.preemption import LeaveCause
from elastic.runtime.session import Session
from elastic.runtime.worker_config import WorkerConfig

log = logging.getLogger("elastic")

# A claim this worker does not see confirmed is reported after this long (and two commits): a
# rank that saw the server's notice early is confirmed by the others within a commit or two.
CLAIM_GRACE_S = 5.0
# A rank that said it leaves has called the rendezvous Leave within this long, or it is reported.
LEAVE_GRACE_S = 5.0
# After the world's return check, how long a worker waits for the server to say the job
# completed (every member reported) before it ends anyway.
FINISH_WAIT_S = 30.0

_LEFT_BY_CAUSE = {LeaveCause.SIGNAL: Preempted, LeaveCause.PROGRAM: LeaveRequested,
                  LeaveCause.STRAGGLER: EvictedAsStraggler}


class JobDone(RendezvousError):
    """The job finished (another worker reported success, or it failed) while this worker waited."""

    def __init__(self, message: str, succeeded: bool):
        super().__init__(message)
        self.succeeded = succeeded


class Ending(enum.Enum):
    """How a session ends, as the rendezvous server is told."""

    SUCCEEDED = "succeeded"   # report success: the job is done
    LEFT = "left"             # leave the job cleanly: the others go on without this worker
    CLOSED = "closed"         # tell nothing (it departed already, or another worker reported success)


class JobSession(Session):
    """The worker's session with its job (see the module doc); ``elastic.init()`` makes the process's one."""

    def __init__(self, config: WorkerConfig):
        super().__init__(job_id=config.job_id)
        self.config = config
        self.trained_here = False   # the training function has run in this worker
        self._forming: Optional[Tuple[int, float]] = None   # (world version, since): its ring is forming
        self.commit_watch.max_steps = config.commit_warn_steps
        self.commit_watch.max_seconds = config.commit_warn_seconds
        # Opened before rendezvous: its address is what this worker announces.
        self.listener = Listener(config.ring_host, 0)
        self.client = RendezvousClient(
            list(config.rendezvous), job_id=config.job_id, worker_id=config.worker_id, host=config.host,
            ring_address=self.listener.address, token=config.token,
            credentials=config.channel_credentials(),
            spec=JobSpec(min_np=config.min_np, max_np=config.max_np, elastic_timeout_s=config.elastic_timeout),
            spec_if_new=JobSpec(min_np=config.min_np_if_new, max_np=config.max_np_if_new))
        # A child forked from here on (a DataLoader's workers) must not keep this worker's stream
        # open after it dies: the server would learn of the death only at the heartbeat timeout.
        self._fork_guard = fork_guard.guard_rendezvous(self.client.addresses)
        self._cond = threading.Condition()
        self._view = reaction.View()
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, name="elastic-rendezvous-pump", daemon=True)
        self._leave_asked = threading.Event()   # set with the request: a join gives up on it
        self.leave_request = preemption.LeaveRequest(config.preempt_grace, config.worker_id,
                                                     on_request=self._on_leave_request)
        self.departed = False   # this worker left the job gracefully (depart() ran)
        self._leave_signals: Optional[preemption.Handlers] = None   # while elastic.run runs
        self._metrics_pusher: Optional[worker_metrics.Pusher] = None
        self._claims: Tuple[int, Dict[int, Tuple[float, int]]] = (0, {})   # world version, rank -> (since, commits)
        self._leaving: Optional[Tuple[int, Tuple[int, ...], float]] = None  # (version, leavers, since)
        self._accused: Set[Tuple[int, str]] = set()   # (version, worker id) reported for a claim
        self._stepped_told = 0   # the newest world the server was told this worker trained in
        self.straggler_detector = straggler_detector.Detector(
            config.stragglers, config.worker_id,
            leave=lambda why: self.leave_request.request(why, LeaveCause.STRAGGLER),
            room=lambda: (self.client.job_spec.min_np, self.client.spares), waited=lambda: self.wait_clock.seconds,
            scored=self._straggler_scored)

    # ------------------------------------------------------------------ lifecycle
    def catch_leave_signals(self) -> None:
        """From now until ``run`` ends, SIGTERM and SIGINT ask this worker to leave
        (``elastic.runtime.preemption``). ``elastic.run`` calls it before the join: a request that
        comes while joining is then a leave at once, not the death of a member just admitted."""
        if self._leave_signals is None:
            self._leave_signals = preemption.install_handlers(self.leave_request.request)

    def release_leave_signals(self) -> None:
        handlers, self._leave_signals = self._leave_signals, None
        preemption.restore_handlers(handlers)

    def start(self) -> None:
        """Joins the job. While leave signals are caught (``elastic.run``), a leave request ends
        a join no server answers with a ``LeftJob``, after the attempt under way: this worker is
        then in no world, so it has nothing to hand on and leaves at once. A join that is
        answered stands, and the worker departs through the rendezvous (``next_world``)."""
        give_up = self._leave_asked if self._leave_signals is not None else None
        try:
            self.client.join(commit_step=-1, give_up=give_up)
        except _ClientError as e:
            self.client.close()
            self.listener.close()
            self.leave_request.finish()
            if isinstance(e, RendezvousCallAbandoned):
                log.warning("worker %s left job %s gracefully (%s) before any server answered its join: %s",
                            self.config.worker_id, self.config.job_id, self.leave_request.why, e)
                raise self._left(world_version=0, commit_step=-1) from None
            raise RendezvousError(f"cannot join job {self.config.job_id!r} at {','.join(self.config.rendezvous)}: "
                                  f"{e}") from None
        self._pump.start()
        self.start_metrics(self.config.metrics_socket, self.config.metrics_token)

    def start_metrics(self, socket_path: Optional[str], token: Optional[str]) -> None:
        """Records this worker's counters and pushes them to ``socket_path`` (none given: nothing)."""
        self.stop_metrics()
        self._metrics_pusher = worker_metrics.start(socket_path, token, self.config.worker_id)
        self.metrics = self._metrics_pusher.recorder if self._metrics_pusher is not None else None
        if self.comm is not None:
            self.comm.observer = self.metrics

    def stop_metrics(self) -> None:
        """Sends the last snapshot and stops recording."""
        pusher, self._metrics_pusher, self.metrics = self._metrics_pusher, None, None
        if self.comm is not None:
            self.comm.observer = None
        if pusher is not None:
            pusher.close()

    def _straggler_scored(self, score: float) -> None:
        if self.metrics is not None:
            self.metrics.straggler_score = score

    def finish(self, ending: Ending, keep_ring: bool = False) -> None:
        """Ends this worker's part: tells the server how (``ending``) and releases everything
        but, with ``keep_ring``, the ring of the last world (collectives after the run).

        A success report completes the job only once every member of the world reported it at
        the same commit: the worker waits (at most ``FINISH_WAIT_S``) for the server's notice
        before it closes its stream, so that its leaving is not taken for a failure meanwhile."""
        try:
            if self.departed:
                pass   # it told the server already
            elif ending is Ending.SUCCEEDED:
                # The world it returned in is its ring's: a world announced since (a joiner
                # waiting for a commit that never came) is not one it trained in.
                world = self.world.world_version if self.world is not None else None
                self._tell_stepped()
                if not self.client.report_success(world_version=world, commit_step=max(self.commit_step, 0)):
                    self._await_finished(FINISH_WAIT_S)
            elif ending is Ending.LEFT:
                self.client.leave()
        except _ClientError as e:
            finished = self._view.finished
            if ending is Ending.SUCCEEDED and finished is not None:
                log.info("job already finished: %s", finished.reason)
            elif ending is Ending.SUCCEEDED and e.finished is not None:
                log.info("job already finished (another worker reported success first)")
            else:
                log.warning("could not tell the rendezvous server this worker %s: %s", ending.value, e)
        self._stop.set()
        comm = self.comm
        if comm is not None and not (keep_ring and not comm.failed):
            self.close_ring()
        elif comm is not None:
            # Kept for collectives after the run, at most until the exit. Nobody watches its
            # members from here (the session ends), so a member that never enters a collective
            # would hold the others for the collective timeout: each collective on it waits at most
            # ELASTIC_AFTER_RUN_TIMEOUT for every member, and names one that did not come.
            comm.arrival = Arrival(min(self.config.after_run_timeout, comm.config.timeout), self._who)
            atexit.register(self.close_ring)
        self.end()
        self.client.close()
        self._pump.join(timeout=5)
        self.listener.close()
        self.leave_request.finish()
        self.stop_metrics()
        self._fork_guard.release()

    def _await_finished(self, timeout_s: float) -> None:
        with self._cond:
            done = self._cond.wait_for(lambda: self._view.finished is not None or self._view.ended is not None,
                                       timeout_s)
        if not done:
            world = self.world
            log.warning("worker %s: the job is not complete %g s after every rank of world %d returned: a member "
                        "has not reported it (the server completes the job when every member did)",
                        self.config.worker_id, timeout_s, world.world_version if world is not None else 0)

    def _returned_alone(self, why: str) -> None:
        """This worker's function returned while the others train on: it leaves the world, as a
        graceful leave (not a failure, not blacklisted); the others go on without it."""
        world, commit_step = self.world, self.commit_step
        log.warning("worker %s: its function returned at commit %d of world version %d while the others train on "
                    "(%s): it leaves the world; the job goes on without it", self.config.worker_id, commit_step,
                    world.world_version if world is not None else 0, why)
        self._stop.set()
        try:
            self.client.leave()
        except _ClientError as e:   # it is evicted when its stream ends instead
            log.warning("worker %s could not tell the rendezvous server it leaves: %s", self.config.worker_id, e)
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        self.departed = True

    def _who(self, rank: int) -> str:
        """``worker W (rank R)`` for rank ``rank`` of this worker's last world, by the id the
        launchers and the rendezvous show; ``rank R`` for a rank outside its view (which names
        its rings' neighbours only)."""
        world = self.world
        member = world.peer(rank) if world is not None and 0 <= rank < world.size else None
        return f"worker {member.worker_id} (rank {rank})" if member is not None else f"rank {rank}"

    def _named(self, err: BaseException) -> str:
        """``worker W (rank R): `` for the peer a ring error blames, by the id the launchers and
        the rendezvous show ("" when it blames none)."""
        world, peer = self.world, getattr(err, "peer_rank", None)
        if world is None or peer is None or getattr(err, "world_version", -1) != world.world_version \
                or not 0 <= peer < world.size:
            return ""
        return f"{self.name_rank(peer)}: "

    def depart(self) -> LeftJob:
        """Leaves the job gracefully: the rendezvous Leave, then the ring closed; returns the
        ``LeftJob`` that ends ``elastic.run``. Called at a commit boundary every rank agreed on
        (after its allreduce: until then the ring is in use), or holding no ring in use."""
        world, commit_step = self.world, self.commit_step
        self._stop.set()
        try:
            self.client.leave(straggler=self.leave_request.straggler)
        except _ClientError as e:   # it is evicted when its stream ends instead: the others restore
            log.warning("worker %s could not tell the rendezvous server it leaves: %s", self.config.worker_id, e)
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None:
            self.release_ring(comm)
        self.departed = True
        self.leave_request.finish()
        version = world.world_version if world is not None else 0
        log.warning("worker %s left job %s gracefully (%s) at %s of world version %d", self.config.worker_id,
                    self.config.job_id, self.leave_request.why, describe_commit(commit_step, self.state), version)
        return self._left(world_version=version, commit_step=commit_step)

    def _tell_stepped(self) -> None:
        """Tells the server the newest world this worker trained in, if the pump has not yet: a
        job that ends within the pump's turn of its first step in a world would otherwise end
        with Status saying nobody trained in it, and its launchers never count the recovery."""
        if self.stepped_world > self._stepped_told:
            self._report_progress(self.commit_step, None, self.stepped_world)

    def _report_progress(self, commit_step: int, verdict, stepped: int) -> bool:
        """One ReportProgress; False when it failed (logged only: what it says is resent, and
        nothing waits on it)."""
        try:
            self.client.report_progress(commit_step=commit_step, straggler=verdict, stepped_world=stepped,
                                        step=training_step(self.state))
        except _ClientError as e:
            log.debug("progress report failed: %s", e)
            return False
        self._stepped_told = max(stepped, self._stepped_told)
        return True

    def _left(self, world_version: int, commit_step: int) -> LeftJob:
        """The exception that says why this worker left: preempted, asked to, or evicted as a straggler."""
        kind = _LEFT_BY_CAUSE[self.leave_request.cause]
        return kind(self.leave_request.why, world_version=world_version, commit_step=commit_step,
                    held=describe_commit(commit_step, self.state))

    def _on_leave_request(self) -> None:
        self._leave_asked.set()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ events
    def _pump_loop(self) -> None:
        reported, last_report, told, noted = -1, 0.0, None, 0
        while not self._stop.is_set():
            # A ring that takes long to form waits for members still in the running world: they
            # switch at their next commit. Say so once per world, not only when the form times out.
            forming = self._forming
            if forming is not None and forming[0] != noted and \
                    time.monotonic() - forming[1] >= joiner_note_after(self.config.comm.form_timeout):
                noted = forming[0]
                log.warning("%s", joiner_waits(self.config.worker_id, time.monotonic() - forming[1], forming[0],
                                               self.config.comm.form_timeout))
            ev = self.client.next_event(0.2)
            if ev is not None:
                with self._cond:
                    try:
                        self._apply(ev)
                    except Exception:  # this thread must outlive any one event, or the worker goes deaf
                        log.exception("worker %s: error handling rendezvous event %r", self.config.worker_id, ev)
                    self._cond.notify_all()
            # Progress reports let the server make the most advanced worker rank 0 of the next
            # world. Sent from here, at most once a second, so commit() never waits on the network.
            # The straggler verdict rides along (elastic.runtime.straggler_detector), at once when it
            # names this worker.
            commit_step, verdict, stepped = self.commit_step, self.straggler_detector.report, self.stepped_world
            named = verdict is not None and verdict.named and not (told is not None and told.named and
                                                                   told.world_version == verdict.world_version)
            # The first step in a new world goes at once: the launchers count a recovery to it.
            stepped_told = self._stepped_told
            if (commit_step != reported or verdict is not told or stepped != stepped_told) and \
                    (named or stepped != stepped_told or time.monotonic() - last_report >= 1.0):
                try:
                    if self._report_progress(commit_step, verdict, stepped):
                        reported, told = commit_step, verdict
                        self.straggler_detector.told(verdict)
                except ValueError:
                    if self._stop.is_set():   # finish() closed the client's channel under this call
                        return
                    raise
                last_report = time.monotonic()

    def _apply(self, ev) -> None:
        self._view, actions = reaction.react(self._view, ev)
        for action in actions:
            if isinstance(action, reaction.AbortRing):
                self.abort_ring(action.reason)
            elif isinstance(action, reaction.Note):
                log.info("worker %s %s", self.config.worker_id, action.message)

    # ------------------------------------------------------------------ worlds
    def membership_pending(self) -> bool:
        with self._cond:
            return reaction.membership_pending(self._view)

    def heard_claims(self, comm: Communicator, claimers: Tuple[int, ...]) -> None:
        """A claim of a pending change that this worker does not see confirmed by the server,
        made at two commits or more and for ``CLAIM_GRACE_S``, is reported (``FALSE_PENDING``):
        the server checks it against what it announced and, when the majority reported it too,
        evicts the claimer. The others train on meanwhile: a minority's claim changes nothing."""
        version, now = comm.world_version, time.monotonic()
        if self.membership_pending() or self._claims[0] != version:
            self._claims = (version, {})
        if self.membership_pending():
            return
        before = self._claims[1]
        claims = {r: (before.get(r, (now, 0))[0], before.get(r, (now, 0))[1] + 1) for r in claimers if r != comm.rank}
        self._claims = (version, claims)
        for r, (since, boundaries) in claims.items():
            if boundaries >= 2 and now - since >= CLAIM_GRACE_S:
                self._accuse(version, r, Blame.FALSE_PENDING,
                             f"rank {r} has claimed a membership change of world version {version} for {now - since:.1f} s "
                             "that the rendezvous never announced to this worker")

    def expect_leave(self, comm: Communicator, leavers: Tuple[int, ...]) -> None:
        """Ranks said at this commit that they leave: ``next_world`` reports each that has not
        done so (no change announced) after ``LEAVE_GRACE_S`` (``FALSE_LEAVE``)."""
        world = self.world
        if world is not None and world.world_version == comm.world_version:
            self._leaving = (comm.world_version, tuple(leavers), time.monotonic())

    def _check_leavers(self, view: reaction.View) -> None:
        """Called waiting for the next world: leavers the server never saw leave are reported."""
        if self._leaving is None:
            return
        version, leavers, since = self._leaving
        if view.pending_version >= version or view.aborted_version >= version or view.seen_version > version:
            self._leaving = None   # the server announced the change: they left
        elif time.monotonic() - since >= LEAVE_GRACE_S:
            self._leaving = None
            for r in leavers:
                self._accuse(version, r, Blame.FALSE_LEAVE,
                             f"rank {r} said at a commit of world version {version} that it leaves, and "
                             f"{LEAVE_GRACE_S:g} s later the rendezvous had announced no change")

    def _accuse(self, version: int, rank: int, blame: Blame, why: str) -> None:
        """Reports rank ``rank`` of world ``version`` to the server for ``blame``, once, from a
        thread of its own: the server waits for the majority's reports before it answers."""
        world = self.world
        if world is None or world.world_version != version or not 0 <= rank < world.size:
            return
        # Named by rank: this worker's view of the world names only its rings' neighbours, the
        # server maps the rank of `version` to its member.
        member = world.peer(rank)
        suspect = member.worker_id if member is not None else f"rank {rank}"
        if (version, suspect) in self._accused:
            return
        self._accused = {(v, w) for v, w in self._accused if v >= version} | {(version, suspect)}   # this world's only
        log.warning("worker %s reports %s (%s): %s", self.config.worker_id, suspect, blame.value.lower(), why)

        def accuse() -> None:
            try:
                evicted = self.client.report_failure("", version, reason=why[:1000], blame=blame, suspect_rank=rank)
                log.info("reported %s (world %d): %s", suspect, version, "evicted" if evicted else "not evicted")
            except Exception as e:  # noqa: BLE001 (closed meanwhile, or the server unreachable: nothing to do)
                log.debug("could not report %s: %s", suspect, e)

        threading.Thread(target=accuse, name="elastic-accuse", daemon=True).start()

    def leave_pending(self) -> bool:
        return self.leave_request.pending

    def next_world(self, min_version: int) -> WorldInfo:
        """Waits for the newest world (version >= min_version) that includes this worker."""
        deadline = time.monotonic() + self.config.world_timeout
        with self._cond:
            while not self.leave_request.pending:
                view = self._view
                if view.finished is not None:
                    raise JobDone(f"job {self.config.job_id} finished: {view.finished.reason}",
                                  view.finished.succeeded)
                if view.ended is not None:
                    # Forget the old membership before the lock is released: worlds that arrive
                    # while joining belong to the new one.
                    self._view, min_version = reaction.rejoined(view)
                    self._rejoin(view.ended)
                    continue
                w = reaction.world_to_take(view, min_version)
                if w is not None:
                    return w
                self._check_leavers(view)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ElasticTimeout(
                        f"worker {self.config.worker_id} of job {self.config.job_id}: no world (version >= "
                        f"{min_version}) included it within {self.config.world_timeout:g} s (ELASTIC_WORLD_TIMEOUT)")
                self._cond.wait(min(left, 1.0))
        # Asked to leave while waiting: no ring of this worker is in use, it may go now.
        raise self.depart()

    def _rejoin(self, ended: Ended) -> None:
        """Joins again as a new member after the session ended (called holding the lock)."""
        if ended.finished is not None:  # e.g. evicted while stopped, woken after the end
            raise JobDone(f"job {self.config.job_id} finished without worker {self.config.worker_id}: "
                          f"{ended.reason}", ended.finished)
        log.warning("session of worker %s ended (%s); joining again as a new member", self.config.worker_id,
                    ended.reason)
        self._cond.release()
        try:
            self.client.join(commit_step=self.commit_step)
        except _ClientError as e:
            if e.finished is not None:
                raise JobDone(f"job {self.config.job_id} finished without worker {self.config.worker_id}: {e}",
                              e.finished) from None
            raise RendezvousError(f"cannot rejoin job {self.config.job_id}: {e}") from None
        finally:
            self._cond.acquire()

    def form(self, world: WorldInfo) -> Communicator:
        """Forms the ring of ``world``; raises WorkerLostError if it is aborted or superseded meanwhile."""
        # The job's random secret, from the server's answer to this worker's Join.
        comm = Communicator.create(listener=self.listener, job_id=self.config.job_id,
                                   secret=self.client.ring_secret, world_version=world.world_version, rank=world.rank,
                                   view=RingView.of_world(world),  # its neighbours; same host: shared memory
                                   config=self.config.comm, wait_clock=self.wait_clock, observer=self.metrics)
        with self._cond:
            old, self.comm, self.world = self.comm, comm, world
            self._view = reaction.holding(self._view, world.world_version)
            superseded = reaction.superseded(self._view, world.world_version)
        if old is not None:
            old.close()
        if superseded:
            self.abort_ring(f"world version {world.world_version} was superseded before it formed", comm)
        self._forming = (world.world_version, time.monotonic())
        try:
            comm.connect()
        finally:
            self._forming = None
        with self._cond:
            self._view = reaction.holding(self._view, world.world_version, formed=True)
            if reaction.aborted_while_forming(self._view, world.world_version):
                self.abort_ring(f"world version {world.world_version} was aborted while forming", comm)
        self.check_divergence(comm)   # the first collective of every ring, whoever formed it (elastic.init too)
        if self.metrics is not None:
            self.metrics.world_formed(world.world_version, world.rank, world.size)
        world_env.publish(world.rank, world.size)
        return comm

    def report_failure(self, err: Union[WorkerLostError, CollectiveMismatchError]) -> None:
        """Tells the server which peer broke, so it checks that peer at once instead of at its timeout.

        A ``BadPeerError`` is an accusation (its ``blame``: an unusable address, an impossible
        row, a divergence): the server evicts that peer even though it is alive once the
        majority of the world accused it too, since such a member can never be in a ring. A
        collective mismatch reports its sender as failed: the probe finds it alive and the
        world is formed again, where its members compare what they called."""
        world = self.world
        # No peer to blame: aborted (the server already knows) or propagated (the neighbour is
        # alive, the failed rank is further on and its own neighbour reports it).
        rank = err.peer if isinstance(err, CollectiveMismatchError) and err.peer >= 0 else err.peer_rank
        if world is None or rank is None or err.world_version != world.world_version or rank == world.rank \
                or not 0 <= rank < world.size:
            return
        # A rank outside this worker's view (no neighbour of its rings) is named by its rank:
        # the server maps the rank of that world to its member.
        peer = world.peer(rank)
        suspect = peer.worker_id if peer is not None else f"rank {rank}"
        try:
            evicted = self.client.report_failure(peer.worker_id if peer is not None else "", world.world_version,
                                                 reason=str(err)[:1000], timed_out=err.kind == ErrorKind.Timeout,
                                                 blame=err.blame if isinstance(err, BadPeerError) else Blame.NONE,
                                                 suspect_rank=None if peer is not None else rank)
            # Not evicted by this report: gone already (its stream broke first: a SIGKILL), or alive.
            log.info("reported %s (world %d): %s", suspect, world.world_version,
                     "evicted" if evicted else "not evicted by this report (gone already, or it proved alive)")
        except _ClientError as e:
            log.warning("could not report failed peer %s: %s", suspect, e)

    # ------------------------------------------------------------------ the loop
    def run(self, func: Callable, state: Any, args: tuple, kwargs: dict, reset_limit: int) -> Any:
        """Runs ``func(state, *args, **kwargs)`` to completion across failures and world changes
        and returns its result; ends the session (success reported, or left) either way."""
        resets, first, min_version, restored = 0, True, 1, False
        ending = Ending.LEFT
        self.state = state
        self.catch_leave_signals()
        for h in self.hooks:
            h.run_starting(self.config.default_group)
        try:
            while True:
                try:
                    ring_world_version = self.world.world_version if self.comm is not None else 0
                    if reaction.must_form(ring_world_version, self.comm is not None and self.comm.failed, min_version):
                        self._form_next(min_version, restored)
                    if not first:
                        state.on_reset()
                    # The most advanced rank's state, after its reset callbacks, goes to everyone.
                    self.sync(state)
                    first = restored = False
                    self.trained_here = True   # its function ran: a restore of commit -1 now undoes work
                    result = self._call(func, state, args, kwargs)
                    comm = self.ring("the end of the run")
                    state.make_last_commit_durable(comm, comm.config.timeout / 2)
                    state.on_finish()
                    # Success is the world's: every rank's function returned at this same point.
                    try:
                        together, why = self.check_return(), "they did not return with it"
                    except ElasticError as e:   # a training rank's collective met this one
                        together, why = False, f"{self._named(e)}{type(e).__name__}: {e}"
                    if together:
                        ending = Ending.SUCCEEDED
                    else:
                        self._returned_alone(why)
                        ending = Ending.CLOSED
                    return result
                except (WorkerLostError, HandshakeError, MembershipChanged, CollectiveMismatchError) as e:
                    ring_world_version = self.world.world_version if self.world is not None else 0
                    self.record_failure(e, ring_world_version)
                    if isinstance(e, CollectiveMismatchError):
                        with self._cond:
                            moved_on = reaction.world_moved_on(self._view, e.world_version)
                        plan = reaction.after_mismatch(e, ring_world_version, state.live_state_usable(), moved_on)
                        if plan is None:
                            raise
                        log.warning("%s; %s", e, f"world version {e.world_version} ended meanwhile (a member left): "
                                    "re-forming without it" if moved_on else "the world is formed again and its "
                                    "members compare what they called")
                    else:
                        plan = reaction.after_error(e, ring_world_version, state.live_state_usable())
                    min_version, restored = plan.min_version, self.recover(e, plan, state)
                resets += 1
                if reset_limit and resets > reset_limit:
                    raise RendezvousError(f"elastic.run: gave up after {reset_limit} re-forms (reset limit)")
        except JobDone as e:
            if e.succeeded:
                log.info("%s", e)
                ending = Ending.CLOSED  # another worker reported success; nothing more to say
                return None
            # A job fails only by staying below min_np for its elastic timeout.
            raise ElasticTimeout(str(e)) from None
        except LeftJob:
            ending = Ending.CLOSED   # left: depart() told the server
            raise
        except (SettingsMismatchError, CollectiveMismatchError) as e:
            if not e.outvoted:
                raise
            ending = Ending.CLOSED   # no graceful leave: the majority's reports evict it, counted against its host
            log.error("worker %s: %s", self.config.worker_id, e)
            raise Outvoted(e) from e
        finally:
            self.release_leave_signals()
            # The last durable commit may still be on the writer thread: on disk before success
            # is reported and before the code after training runs (a deadline, logged if missed).
            state.finish_durable_commits()
            # A worker whose function returned keeps its last world's ring: torchrun scripts end
            # with dist.barrier(), a last all_reduce of metrics, destroy_process_group().
            self.finish(ending, keep_ring=ending is Ending.SUCCEEDED)

    def _form_next(self, min_version: int, restored: bool) -> None:
        started, previous = time.monotonic(), self.world
        self.form(self.next_world(min_version))
        log.info("worker %s is rank %d of %d in world version %d (formed in %.3f s)", self.config.worker_id,
                 self.world.rank, self.world.size, self.world.world_version, time.monotonic() - started)
        change = WorldChange(previous, self.world, restored)
        for h in self.hooks:
            h.world_changed(change)

    def recover(self, error: BaseException, plan: reaction.Recovery, state: Any) -> bool:
        """Carries out ``plan`` for ``error``; returns whether the state was rolled back."""
        action = plan.state
        if plan.stale:   # a neighbour at another world version: ours is stale
            log.warning("%s", error)
        elif action is reaction.StateAction.KEEP_LIVE:
            commit, since = state.standing()
            log.warning("%s; keeping the live state (%s and %d step(s) since, none half done)",
                        error, describe_commit(commit, state), since)
        elif action is reaction.StateAction.RESTORE and state.commit_step < 0 and self.trained_here:
            # The one restore that loses everything: say so where nobody can miss it.
            lost = f" ({self.commit_watch.trained} training step(s) of this worker are lost)" \
                if self.commit_watch.trained else ""
            log.error("%s; restoring commit -1: no state.commit() was made in this run, so training RESTARTS FROM "
                      "THE BEGINNING%s. Call state.commit() every few steps inside the @elastic.run function",
                      error, lost)
        elif action is reaction.StateAction.RESTORE:
            log.warning("%s; restoring %s", error, describe_commit(state.commit_step, state))
        else:
            log.info("%s", error)
        if action is not reaction.StateAction.KEEP and self.metrics is not None:
            self.metrics.failure(state.commit_step, kept=action is reaction.StateAction.KEEP_LIVE)
        if action is reaction.StateAction.KEEP_LIVE:
            state.keep_live()
        elif action is reaction.StateAction.RESTORE:
            state.restore()
        if plan.report:
            self.report_failure(error)
        return action is reaction.StateAction.RESTORE

    def _call(self, func: Callable, state: Any, args: tuple, kwargs: dict) -> Any:
        """``func(state, …)``; an error a layer above made of a ring failure (DDP's backward raises
        a RuntimeError when its comm hook's allreduce fails) becomes that ring's WorkerLostError."""
        try:
            return func(state, *args, **kwargs)
        except (WorkerLostError, CollectiveMismatchError, MembershipChanged, HandshakeError, RendezvousError):
            raise
        except Exception as e:
            lost = self.noted_failure()
            if lost is not None:
                raise lost from e
            raise
