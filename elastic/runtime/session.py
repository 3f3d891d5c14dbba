"""The worker's session with its job: the one owner of the step protocol.

One ``Session`` per process (``elastic.init()`` makes it). It holds the ring listener, the
rendezvous client and the current ring (entered in ``elastic.runtime.world``, where ``rank()``,
``size()`` … and the collectives read it), and it alone decides when the ring is formed,
aborted, synced and left. This docstring is the one description of the step protocol; other
modules point here.

The step protocol (``Session.run``, what ``elastic.run`` runs)::

    join -> form the ring of the next world -> [world_changed] -> reset callbacks -> sync -> func(state)
    func calls state.commit(): snapshot -> [committed] -> durable write (rank 0, every n-th)
                               -> membership check (one allreduce every rank agrees on)
    an error ends func, a form or a sync; ``reaction.after_error`` decides what comes next:
      a peer failed (WorkerLostError)        : restore the last commit, report the suspect, next world
      a stale neighbour (HandshakeError)     : restore, next world
        (both keep the live state instead where the State can: ``State.keep_live``; the sync then
        takes the most advanced rank's, so survivors that stood at different steps agree)
      a clean join/leave (MembershipChanged) : keep the state, next world (at a commit every rank agrees on)
      asked to leave (SIGTERM, SIGINT, request_leave): leave at the next commit, raise Preempted
    sync: [before_sync] -> the most advanced rank's state to everyone (``elastic.state.sync``)
          -> [after_sync]

- **commit** (``commit``): ``State.take_snapshot`` copies the live state; the session records
  the step (its pump reports it to the rendezvous, which makes the most advanced worker rank 0 of
  the next world); rank 0 hands every ``checkpoint_every``-th commit to the State's durable
  writer; then ``check_membership``.
- **membership check** (``check_membership``): one small allreduce of [a change is pending, this
  rank wants to leave] (each rank's straggler timings ride along, ``elastic.runtime.straggler_detector``); a rank
  that knows tells all the others, so every rank switches at this same commit. A leave request (``elastic.runtime.preemption``) is carried out here: the leaver calls the
  rendezvous Leave, closes its ring and ends ``elastic.run`` with ``Preempted``; the others raise
  MembershipChanged and form the next world without it, their state kept. A worker asked to
  leave while it waits for a world (on standby, say) holds no ring anyone uses and leaves at once.
- **sync** (``sync``): every rank ends holding the same bits, the commit of the most advanced
  rank (or rank 0's state before any); how: ``elastic.state.sync``.

``State`` only takes, encodes and adopts snapshots; when it does is decided here. Outside a
session (a ring installed by hand with ``elastic.runtime.world.use_ring``) ``protocol()`` answers with
the same commit, check and sync, with no membership change ever pending.

The session's pump thread reads the rendezvous events and carries out what ``elastic.runtime.reaction``
decides they mean (abort the ring in flight, record a pending change), so a collective stuck on
a stopped peer fails within milliseconds of the announcement.

Hooks (``elastic.runtime.hooks``): the layers above the ring (the torch group and DDP, a sharded state)
subclass ``StepHooks`` and ``add_hooks`` an instance; the session imports none of them. Each hook
runs on every rank of the world at the same point, in registration order:

- ``run_starting(default_group)``: ``elastic.run`` begins, before the first world (the torch
  group makes itself torch.distributed's default group here);
- ``world_changed(WorldChange(previous, current, restored))``: after each ring of a new world
  formed, before the reset callbacks and the sync: the previous and the new world (members by
  worker id, in rank order) and whether the state was rolled back (rebuild what depends on the
  world: a ``DeviceMesh``, an FSDP model over it);
- ``before_sync(state)`` / ``after_sync(state, root)``: around every sync, on its ring (DDP
  broadcasts the modules the state does not hold and rebuilds its reducers after it);
- ``committed(state, step)``: after each commit's snapshot, before its membership check, on the
  ring of the commit (collectives allowed: copy shards, send a copy to the ring neighbour with
  ``Communicator.shift``);
- ``failure_behind(error)``: the ring failure behind an exception that escaped the training
  function (torch makes a ``RuntimeError`` of a failed DDP comm hook), handled as that failure.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any, Callable, Optional, Union


from rendezvous.common.channel import RendezvousCallAbandoned
from rendezvous.common.channel import RendezvousRPCError as _ClientError
from rendezvous.wire.membership import JobSpec
from rendezvous.client.watch_events import Ended, WorldInfo
from rendezvous.client.worker_client import RendezvousClient

from elastic.runtime import (fork_guard, hooks, logs, worker_metrics as metrics, preemption, reaction,
    straggler_detector as stragglers, world_env)
from elastic.state import sync as state_sync
from elastic.runtime import world as _world
from elastic.ring.errors import ErrorKind
from elastic.ring.communicator import CommConfig, Communicator, Listener
from elastic.ring.wait_clock import WaitClock
from elastic.runtime.worker_config import WorkerConfig
from elastic.ring.errors import (BadPeerError, ElasticTimeout, HandshakeError, MembershipChanged, Preempted,
    RendezvousError, WorkerLostError)
from elastic.ring.ops import Max

log = logging.getLogger("elastic")


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


class StepProtocol:
    """The commit, membership check and sync of the step protocol (see the module doc), on the
    ring ``elastic.runtime.world.ring()`` gives. ``Session`` is the one that runs a job; this base class
    alone serves a ring installed by hand: no change is ever pending, no leave requested, and no
    step is reported."""

    straggler_detector: Optional[stragglers.Detector] = None   # a session's: rides on check_membership

    def membership_pending(self) -> bool:
        """True when a clean join/leave is waiting to take effect at the next commit."""
        return False

    def leave_pending(self) -> bool:
        """True when this worker was asked to leave (at its next commit)."""
        return False

    def record_commit(self, step: int) -> None:
        """The state holds commit ``step`` now (taken or synced)."""

    def depart(self) -> Preempted:
        raise RendezvousError("only a session can leave a job")

    def commit(self, state) -> None:
        """``state.commit()``: a snapshot in memory, then the boundary every rank agrees on."""
        state.take_snapshot()
        self.record_commit(state.commit_step)
        for h in hooks.registered():
            h.committed(state, state.commit_step)
        if state.checkpoint_due() and _world.rank_now() == 0:
            state.write_checkpoint(wait_s=_durable_wait_s())  # written on the State's writer thread
        self.check_membership()

    def check_membership(self) -> None:
        """Raises MembershipChanged on every rank at once when a clean join/leave is pending, or
        when a rank was asked to leave; on that rank it raises ``Preempted`` after it left.

        One small allreduce (Max of [a change is pending, this rank wants to leave]): a rank that
        knows tells all the others, so they all switch at this same commit. Each rank's compute and
        wait seconds since the last window ride along in slots of its own (``elastic.runtime.straggler_detector``).
        """
        comm = _world.ring()
        leaving = self.leave_pending()   # read once: what this rank tells the others
        detector = self.straggler_detector
        flags = stragglers.agreement(detector, comm, self.membership_pending(), leaving)
        comm.allreduce_(flags, Max)
        if detector is not None:
            detector.judge(flags, comm)
        if flags[1]:
            _farewell(comm)
            if leaving:
                raise self.depart()
            raise MembershipChanged(f"a worker leaves world version {comm.world_version}; re-forming without it")
        if flags[0]:
            raise MembershipChanged(f"membership of world version {comm.world_version} changed; re-forming")

    def sync(self, state) -> None:
        """Makes every rank hold the most advanced rank's commit (or rank 0's state before any)."""
        comm = _world.ring()
        for h in hooks.registered():
            h.before_sync(state)
        root, step = state_sync.transfer(comm, state)
        self.record_commit(step)
        for h in hooks.registered():   # DDP modules and the default group follow the new world
            h.after_sync(state, root)


def _durable_wait_s() -> float:
    """How long a durable commit may wait for the previous write still running: half the
    collective timeout, so the other ranks, already in the boundary's allreduce, never take
    this live rank for a dead one."""
    comm = _world.current_ring()
    return (comm.config.timeout if comm is not None else CommConfig().timeout) / 2


def _farewell(comm: Communicator) -> None:
    """One barrier after the allreduce that announced a leave. When it completes on a leaver,
    every rank has the allreduce's result, so closing the leaver's ring then fails nobody's
    commit. A failure in it (a leaver closed first) is no failure of the commit: every rank
    agreed already, and this ring is not used again."""
    try:
        comm.barrier()
    except WorkerLostError as e:
        log.debug("farewell barrier of world version %d: %s", comm.world_version, e)


class Session(StepProtocol):
    """The worker's session with its job (see the module doc); ``elastic.init()`` makes the process's one."""

    def __init__(self, config: WorkerConfig):
        self.config = config
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
        fork_guard.guard_rendezvous(self.client.addresses)
        self._cond = threading.Condition()
        self._view = reaction.View()
        self.comm: Optional[Communicator] = None   # the ring of `self.world`, formed or forming
        self.world: Optional[WorldInfo] = None
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, name="elastic-rendezvous-pump", daemon=True)
        self.committed_step = -1
        self._leave_asked = threading.Event()   # set with the request: a join gives up on it
        self.leave_request = preemption.LeaveRequest(config.preempt_grace, config.worker_id,
                                                     on_request=self._on_leave_request)
        self.departed = False   # this worker left the job gracefully (depart() ran)
        self._leave_signals: Optional[preemption.Handlers] = None   # while elastic.run runs
        self.wait_clock = WaitClock()   # every ring of this session counts its waits here
        self.straggler_detector = stragglers.Detector(
            config.stragglers, config.worker_id, leave=lambda why: self.leave_request.request(why, straggler=True),
            room=lambda: (self.client.job_spec.min_np, self.client.spares), waited=lambda: self.wait_clock.seconds)

    # ------------------------------------------------------------------ lifecycle
    def catch_leave_signals(self) -> None:
        """From now until ``run`` ends, SIGTERM and SIGINT ask this worker to leave
        (``elastic.runtime.preemption``). ``elastic.run`` calls it before the join: a request that comes
        while joining is then a leave at once, not the death of a member just admitted."""
        if self._leave_signals is None:
            self._leave_signals = preemption.install_handlers(self.leave_request.request)

    def release_leave_signals(self) -> None:
        handlers, self._leave_signals = self._leave_signals, None
        preemption.restore_handlers(handlers)

    def start(self) -> None:
        """Joins the job. While leave signals are caught (``elastic.run``), a leave request ends
        a join no server answers with ``Preempted``, after the attempt under way: this worker is
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
                raise Preempted(self.leave_request.why, world_version=0, commit_step=-1) from None
            raise RendezvousError(f"cannot join job {self.config.job_id!r} at {','.join(self.config.rendezvous)}: "
                                  f"{e}") from None
        self._pump.start()
        metrics.start(self.config.metrics_socket, self.config.metrics_token, self.config.worker_id)

    def shutdown(self, ending: Ending, keep_ring: bool = False) -> Optional[Communicator]:
        """Ends this worker's part: tells the server how (``ending``) and releases everything
        but, with ``keep_ring``, the ring of the last world, which it returns."""
        self._stop.set()
        try:
            if self.departed:
                pass   # it told the server already
            elif ending is Ending.SUCCEEDED:
                self.client.report_success()
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
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None and not (keep_ring and not comm.failed):
            comm.close()
            comm = None
        self.client.close()
        self._pump.join(timeout=5)
        self.listener.close()
        self.leave_request.finish()
        metrics.stop()
        return comm

    def depart(self) -> Preempted:
        """Leaves the job gracefully: the rendezvous Leave, then the ring closed; returns the
        ``Preempted`` that ends ``elastic.run``. Called at a commit boundary every rank agreed
        on (after its allreduce: until then the ring is in use), or holding no ring in use."""
        world, step = self.world, self.committed_step
        self._stop.set()
        try:
            self.client.leave(straggler=self.leave_request.straggler)
        except _ClientError as e:   # it is evicted when its stream ends instead: the others restore
            log.warning("worker %s could not tell the rendezvous server it leaves: %s", self.config.worker_id, e)
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        self.departed = True
        self.leave_request.finish()
        version = world.version if world is not None else 0
        log.warning("worker %s left job %s gracefully (%s) at commit %d of world version %d", self.config.worker_id,
                    self.config.job_id, self.leave_request.why, step, version)
        return Preempted(self.leave_request.why, world_version=version, commit_step=step)

    def _on_leave_request(self) -> None:
        self._leave_asked.set()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ events
    def _pump_loop(self) -> None:
        reported, last_report, told = -1, 0.0, None
        while not self._stop.is_set():
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
            # The straggler verdict rides along (elastic.runtime.straggler_detector), at once when it names this worker.
            step, verdict = self.committed_step, self.straggler_detector.report
            named = verdict is not None and verdict.named and not (told is not None and told.named and
                                                                   told.world_version == verdict.world_version)
            if (step != reported or verdict is not told) and (named or time.monotonic() - last_report >= 1.0):
                try:
                    self.client.report_progress(commit_step=step, straggler=verdict)
                    reported, told = step, verdict
                    self.straggler_detector.told(verdict)
                except _ClientError as e:
                    log.debug("progress report failed: %s", e)
                except ValueError:
                    if self._stop.is_set():   # shutdown closed the client's channel under this call
                        return
                    raise
                last_report = time.monotonic()

    def _apply(self, ev) -> None:
        self._view, actions = reaction.react(self._view, ev)
        for action in actions:
            if isinstance(action, reaction.AbortRing):
                if self.comm is not None:
                    self.comm.abort(action.reason)
            elif isinstance(action, reaction.Note):
                log.info("worker %s %s", self.config.worker_id, action.message)

    # ------------------------------------------------------------------ worlds
    def membership_pending(self) -> bool:
        with self._cond:
            return reaction.membership_pending(self._view)

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
            self.client.join(commit_step=self.committed_step)
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
                                   secret=self.client.ring_secret, world_version=world.version, rank=world.rank,
                                   peers=[m.ring_address for m in world.members],
                                   hosts=[m.host for m in world.members],  # same host: shared memory
                                   config=self.config.comm, wait_clock=self.wait_clock,
                                   observer=metrics.recorder())
        with self._cond:
            old, self.comm, self.world = self.comm, comm, world
            self._view = reaction.holding(self._view, world.version)
            superseded = reaction.superseded(self._view, world.version)
        if old is not None:
            old.close()
        if superseded:
            comm.abort(f"world version {world.version} was superseded before it formed")
        comm.connect()
        with self._cond:
            self._view = reaction.holding(self._view, world.version, formed=True)
            if reaction.aborted_while_forming(self._view, world.version):
                comm.abort(f"world version {world.version} was aborted while forming")
        metrics.world_formed(world.version, world.rank, world.size)
        world_env.publish(world.rank, world.size)
        return comm

    def report_failure(self, err: WorkerLostError) -> None:
        """Tells the server which peer broke, so it checks that peer at once instead of at its timeout.

        A ``BadPeerError`` is reported as an unusable address: the server evicts that peer even
        though it is alive, since a member nobody can connect to can never be in a ring."""
        world = self.world
        # No peer to blame: aborted (the server already knows) or propagated (the neighbour is
        # alive, the failed rank is further on and its own neighbour reports it).
        if world is None or err.peer_rank is None or err.world_version != world.version or \
                not 0 <= err.peer_rank < len(world.members):
            return
        suspect = world.members[err.peer_rank].worker_id
        try:
            evicted = self.client.report_failure(suspect, world.version, reason=str(err)[:1000],
                                                 unusable_address=isinstance(err, BadPeerError),
                                                 timed_out=err.kind == ErrorKind.Timeout)
            log.info("reported %s (world %d): %s", suspect, world.version,
                     "evicted" if evicted else "still alive")
        except _ClientError as e:
            log.warning("could not report failed peer %s: %s", suspect, e)

    def record_commit(self, step: int) -> None:
        self.committed_step = step   # the pump reports it (at most once a second)

    # ------------------------------------------------------------------ the loop
    def run(self, func: Callable, state, args: tuple, kwargs: dict, reset_limit: int) -> Any:
        """Runs ``func(state, *args, **kwargs)`` to completion across failures and world changes
        and returns its result; ends the session (success reported, or left) either way."""
        resets = 0
        first = True
        min_version = 1
        restored = False
        ending = Ending.LEFT
        self.catch_leave_signals()
        for h in hooks.registered():
            h.run_starting(self.config.default_group)
        try:
            while True:
                try:
                    held = self.world.version if self.comm is not None else 0
                    if reaction.must_form(held, self.comm is not None and self.comm.failed, min_version):
                        started, previous = time.monotonic(), self.world
                        self.form(self.next_world(min_version))
                        log.info("worker %s is rank %d of %d in world version %d (formed in %.3f s)",
                                 self.config.worker_id, self.world.rank, self.world.size, self.world.version,
                                 time.monotonic() - started)
                        change = hooks.WorldChange(previous, self.world, restored)
                        for h in hooks.registered():
                            h.world_changed(change)
                    if not first:
                        state.on_reset()
                    # The most advanced rank's state, after its reset callbacks, goes to everyone.
                    state.sync()
                    first = restored = False
                    result = _call(func, state, args, kwargs)
                    state.on_finish()
                    ending = Ending.SUCCEEDED
                    return result
                except (WorkerLostError, HandshakeError, MembershipChanged) as e:
                    recovery = reaction.after_error(e, self.world.version if self.world is not None else 0)
                    # A failure that surfaced before the optimizer changed anything keeps the live
                    # state: nothing is redone (elastic.runtime.step_phase); else the last commit is restored.
                    kept = recovery.restore and state.keep_live()
                    if isinstance(e, HandshakeError):   # a neighbour at another world version: ours is stale
                        log.warning("%s", e)
                    elif kept:
                        log.warning("%s; keeping the live state (commit %d and %d step(s) since, none half done)",
                                    e, *state.sync_position())
                    elif recovery.restore:
                        log.warning("%s; restoring commit %d", e, state.commit_step)
                    else:
                        log.info("%s", e)
                    if recovery.restore:
                        metrics.failure(state, kept)
                    if recovery.restore and not kept:
                        state.restore()
                        restored = True
                    if recovery.report:
                        self.report_failure(e)
                    min_version = recovery.min_version
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
        except Preempted:
            ending = Ending.CLOSED   # left: depart() told the server
            raise
        finally:
            self.release_leave_signals()
            # The last durable commit may still be on the writer thread: on disk before success
            # is reported and before the code after training runs (a deadline, logged if missed).
            state.finish_durable_commits()
            # A worker whose function returned keeps its last world's ring: torchrun scripts end
            # with dist.barrier(), a last all_reduce of metrics, destroy_process_group().
            _end(ending, keep_ring=ending is Ending.SUCCEEDED)


def _call(func: Callable, state, args: tuple, kwargs: dict) -> Any:
    """``func(state, …)``; an error a layer above made of a ring failure (DDP's backward raises
    a RuntimeError when its comm hook's allreduce fails) becomes that ring's WorkerLostError."""
    try:
        return func(state, *args, **kwargs)
    except (WorkerLostError, MembershipChanged, HandshakeError, RendezvousError):
        raise
    except Exception as e:
        for h in hooks.registered():
            lost = h.failure_behind(e)
            if lost is not None:
                raise lost from e
        raise


# ---------------------------------------------------------------------- the process's session
_lock = threading.Lock()


def init(config: Optional[WorkerConfig] = None, *, form: bool = True) -> Session:
    """Joins the job and (unless ``form=False``) forms the ring of the first world that
    includes this worker.

    Idempotent: later calls return the same session. Reads the environment the launcher
    sets (see ``elastic.runtime.worker_config``) unless ``config`` is given. ``elastic.run`` joins through
    ``init_for_run`` and forms inside its recovery loop, so a failure while the first ring
    forms is handled like any other.
    """
    s = _joined(config, leave_signals=False)
    if form and s.world is None:
        s.form(s.next_world(1))
        log.info("worker %s is rank %d of %d in world version %d", s.config.worker_id, s.world.rank,
                 s.world.size, s.world.version)
    return s


def init_for_run() -> Session:
    """The session ``elastic.run`` runs in: joined, its ring formed in the run's loop, and
    SIGTERM/SIGINT a leave request from before the join on (``Session.catch_leave_signals``)."""
    return _joined(None, leave_signals=True)


def _joined(config: Optional[WorkerConfig], leave_signals: bool) -> Session:
    _world.close_after_run()
    with _lock:
        s = active()
        if s is None:
            config = config or WorkerConfig.from_env()
            logs.install(config.log_level)   # before the first line (standby) is logged
            s = Session(config)
            if leave_signals:
                s.catch_leave_signals()
            try:
                s.start()
            except BaseException:
                s.release_leave_signals()
                raise
            _world.attach(s)
    return s


def active() -> Optional[Session]:
    """The process's session, or None outside ``elastic.init()`` … ``shutdown()``."""
    return _world.holder()  # type: ignore[return-value]


def shutdown(success: Union[Ending, bool, None] = True) -> None:
    """Ends this worker's session: ``True`` (``Ending.SUCCEEDED``) reports success, ``False``
    (``Ending.LEFT``) leaves, ``None`` (``Ending.CLOSED``) just closes.

    Its last world stays readable (``rank()``, ``size()`` …); collectives raise from here on."""
    ending = success if isinstance(success, Ending) else \
        {True: Ending.SUCCEEDED, False: Ending.LEFT, None: Ending.CLOSED}[success]
    _world.close_after_run()
    _end(ending, keep_ring=False)


def _end(ending: Ending, keep_ring: bool) -> None:
    with _lock:
        s = active()
        if s is not None:
            _world.detach(s, s.config.job_id)
    if s is None:
        return
    kept = s.shutdown(ending, keep_ring=keep_ring)
    if kept is not None:
        _world.keep_after_run(kept)


def protocol() -> StepProtocol:
    """Who runs ``state.commit()``, ``check_membership()`` and ``sync()`` now: the session, or
    without one the plain protocol on a ring installed by hand (``ring()`` raises without either)."""
    s = active()
    return s if s is not None else _PLAIN


_PLAIN = StepProtocol()


def request_leave(reason: str = "elastic.request_leave()") -> None:
    """Asks this worker to leave the job gracefully at its next commit boundary, as SIGTERM does
    under ``elastic.run``: for platforms that announce preemption another way (a metadata
    endpoint, a notice file). Safe from any thread; later calls change nothing. The grace
    (``ELASTIC_PREEMPT_GRACE``) runs from the first call. ``reason`` goes to the log lines."""
    s = active()
    if s is None:
        raise RendezvousError("elastic.request_leave(): no session: call it while elastic.run (or elastic.init()) "
                              "runs")
    s.leave_request.request(str(reason)[:200])
