"""The worker's session with its job: the one owner of the step protocol.

One ``Session`` per process (``elastic.init()`` makes it). It holds the ring listener, the
rendezvous client and the current ring, and it alone decides when the ring is formed,
aborted, synced and left:

    join -> form the ring of the next world -> sync -> func(state) -> commit ...
      a peer failed (WorkerLostError)     : restore the last commit, report the suspect, next world
      a clean join/leave (MembershipChanged): keep the state, next world (at a commit every rank agrees on)
      asked to leave (SIGTERM, SIGINT, request_leave): leave at the next commit, raise Preempted

A request to leave (``elastic.preemption``) is carried out at the next commit boundary: the
membership allreduce tells every rank, which all switch at that commit; the leaver then calls
the rendezvous Leave, closes its ring and ends ``elastic.run`` with ``Preempted``, the others
raise MembershipChanged and form the next world without it, their state kept. A worker asked to
leave while it waits for a world (on standby, say) holds no ring anyone uses and leaves at once.

Its pump thread reads the rendezvous events and carries out what ``elastic.reaction`` decides
they mean (abort the ring in flight, record a pending change), so a collective stuck on a
stopped peer fails within milliseconds of the announcement. ``State`` only takes and loads
snapshots; the commit boundary (record the step, write a durable commit, agree on a pending
membership change) and the sync are here.

The collectives of ``elastic`` run on ``ring()``: the session's current ring, or one a tool
installed by hand with ``use_ring()``. After the session ends (``elastic.run`` returned),
``rank()``, ``size()`` … keep answering with the last world's values, and ``ring()`` raises
an error saying the job has finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np

from rendezvous.membership import JobSpec
from rendezvous.watch_events import Ended, WorldInfo
from rendezvous.worker_client import RendezvousClient
from rendezvous.channel import RendezvousRPCError as _ClientError

from . import logs, metrics, preemption, reaction, world_env
from ._native import ErrorKind
from .communicator import CommConfig, Communicator, Listener
from .config import WorkerConfig
from .errors import (BadPeerError, ElasticTimeout, HandshakeError, MembershipChanged, Preempted, RendezvousError,
                     SyncRefusedError, WorkerLostError)
from .ops import Max

log = logging.getLogger("elastic")


class JobDone(RendezvousError):
    """The job finished (another worker reported success, or it failed) while this worker waited."""

    def __init__(self, message: str, succeeded: bool):
        super().__init__(message)
        self.succeeded = succeeded


class Session:
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
        self._cond = threading.Condition()
        self._view = reaction.View()
        self.comm: Optional[Communicator] = None   # the ring of `self.world`, formed or forming
        self.world: Optional[WorldInfo] = None
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, name="elastic-rendezvous-pump", daemon=True)
        self.committed_step = -1
        self.leave = preemption.LeaveRequest(config.preempt_grace, config.worker_id, on_request=self._wake)
        self.departed = False   # this worker left the job gracefully (depart() ran)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        try:
            self.client.join(committed_step=-1)
        except _ClientError as e:
            self.listener.close()
            self.leave.finish()
            raise RendezvousError(f"cannot join job {self.config.job_id!r} at {','.join(self.config.rendezvous)}: "
                                  f"{e}") from None
        self._pump.start()
        metrics.start(self.config.metrics_socket, self.config.metrics_token, self.config.worker_id)

    def shutdown(self, success: Optional[bool]) -> None:
        """Ends this worker's part: report success, or leave cleanly, and release everything."""
        self._stop.set()
        try:
            if self.departed:
                pass   # it told the server already
            elif success:
                self.client.report_success()
            elif success is False:
                self.client.leave()
        except _ClientError as e:
            finished = self._view.finished
            if success and finished is not None:
                log.info("job already finished: %s", finished.reason)
            elif success and e.finished is not None:
                log.info("job already finished (another worker reported success first)")
            else:
                log.warning("could not tell the rendezvous server this worker %s: %s",
                            "succeeded" if success else "left", e)
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        self.client.close()
        self._pump.join(timeout=5)
        self.listener.close()
        self.leave.finish()
        metrics.stop()

    def depart(self) -> Preempted:
        """Leaves the job gracefully: the rendezvous Leave, then the ring closed; returns the
        ``Preempted`` that ends ``elastic.run``. Called at a commit boundary every rank agreed
        on (after its allreduce: until then the ring is in use), or holding no ring in use."""
        world, step = self.world, self.committed_step
        self._stop.set()
        try:
            self.client.leave()
        except _ClientError as e:   # it is evicted when its stream ends instead: the others restore
            log.warning("worker %s could not tell the rendezvous server it leaves: %s", self.config.worker_id, e)
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        self.departed = True
        self.leave.finish()
        version = world.version if world is not None else 0
        log.warning("worker %s left job %s gracefully (%s) at commit %d of world version %d", self.config.worker_id,
                    self.config.job_id, self.leave.why, step, version)
        return Preempted(self.leave.why, world_version=version, commit_step=step)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ events
    def _pump_loop(self) -> None:
        reported, last_report = -1, 0.0
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
            step = self.committed_step
            if step != reported and time.monotonic() - last_report >= 1.0:
                try:
                    self.client.heartbeat(committed_step=step)
                    reported = step
                except _ClientError as e:
                    log.debug("progress report failed: %s", e)
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
        """True when a clean join/leave is waiting to take effect at the next commit."""
        with self._cond:
            return reaction.membership_pending(self._view)

    def next_world(self, min_version: int) -> WorldInfo:
        """Waits for the newest world (version >= min_version) that includes this worker."""
        deadline = time.monotonic() + self.config.world_timeout
        with self._cond:
            while not self.leave.pending:
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
            self.client.join(committed_step=self.committed_step)
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
                                   config=self.config.comm)
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
            if self._view.aborted_version >= world.version:
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
        self.committed_step = step

    # ------------------------------------------------------------------ the loop
    def run(self, func: Callable, state, args: tuple, kwargs: dict, reset_limit: int) -> Any:
        """Runs ``func(state, *args, **kwargs)`` to completion across failures and world changes
        and returns its result; ends the session (success reported, or left) either way."""
        resets = 0
        first = True
        min_version = 1
        success: Optional[bool] = False
        handlers = preemption.install_handlers(self.leave.request)
        torch_group = _torch_distributed()
        if torch_group is not None:
            torch_group.install_default_group()
        try:
            while True:
                try:
                    if self.comm is None or self.comm.failed or self.world.version < min_version:
                        started = time.monotonic()
                        self.form(self.next_world(min_version))
                        log.info("worker %s is rank %d of %d in world version %d (formed in %.3f s)",
                                 self.config.worker_id, self.world.rank, self.world.size, self.world.version,
                                 time.monotonic() - started)
                    if not first:
                        state.on_reset()
                    # The most advanced rank's state, after its reset callbacks, goes to everyone.
                    state.sync()
                    first = False
                    result = _call(func, state, args, kwargs)
                    state.on_finish()
                    success = True
                    return result
                except WorkerLostError as e:   # BadPeerError too: reported as an unusable address
                    current = self.world.version if self.world is not None else 0
                    failed_version = max(e.world_version, current)
                    log.warning("%s; restoring commit %d", e, state.commit_step)
                    metrics.failure(state)
                    state.restore()
                    self.report_failure(e)
                    min_version = failed_version + 1
                except HandshakeError as e:
                    # An authenticated neighbour is at another world version: ours is stale.
                    log.warning("%s", e)
                    metrics.failure(state)
                    state.restore()
                    min_version = (self.world.version if self.world is not None else 0) + 1
                except MembershipChanged as e:
                    log.info("%s", e)
                    min_version = self.world.version + 1
                resets += 1
                if reset_limit and resets > reset_limit:
                    raise RendezvousError(f"elastic.run: gave up after {reset_limit} re-forms (reset limit)")
        except JobDone as e:
            if e.succeeded:
                log.info("%s", e)
                success = None  # another worker reported success; nothing more to say
                return None
            # A job fails only by staying below min_np for its elastic timeout.
            raise ElasticTimeout(str(e)) from None
        except Preempted:
            success = None   # left: depart() told the server
            raise
        finally:
            preemption.restore_handlers(handlers)
            # The last durable commit may still be on the writer thread: on disk before success
            # is reported and before the code after training runs (a deadline, logged if missed).
            state.finish_durable_commits()
            shutdown(success)


def _torch_distributed():
    """``elastic.distributed`` when torch.distributed is there (numpy-only installs lack it)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return None
    from . import distributed
    return distributed


def _call(func: Callable, state, args: tuple, kwargs: dict) -> Any:
    """``func(state, …)``; an error torch made of a ring failure (DDP's backward raises a
    RuntimeError when its comm hook's allreduce fails) becomes that ring's WorkerLostError."""
    try:
        return func(state, *args, **kwargs)
    except (WorkerLostError, MembershipChanged, HandshakeError, RendezvousError):
        raise
    except Exception as e:
        torch_group = _torch_distributed()
        lost = torch_group.pending_failure() if torch_group is not None else None
        if lost is None:
            raise
        raise lost from e


# ---------------------------------------------------------------------- the process's session
_lock = threading.Lock()
_session: Optional[Session] = None
_ring: Optional[Communicator] = None        # a ring installed by hand (tools, tests), when no session runs
_last: Optional[Tuple[str, Optional[WorldInfo]]] = None   # (job id, last world) once the session ended


def init(config: Optional[WorkerConfig] = None, *, form: bool = True) -> Session:
    """Joins the job and (unless ``form=False``) forms the ring of the first world that
    includes this worker.

    Idempotent: later calls return the same session. Reads the environment the launcher
    sets (see ``elastic.config``) unless ``config`` is given. ``elastic.run`` joins with
    ``form=False`` and forms inside its recovery loop, so a failure while the first ring
    forms is handled like any other.
    """
    global _session, _last
    with _lock:
        s = _session
        if s is None:
            config = config or WorkerConfig.from_env()
            logs.install(config.log_level)   # before the first line (standby) is logged
            s = Session(config)
            s.start()
            _session, _last = s, None
    if form and s.world is None:
        s.form(s.next_world(1))
        log.info("worker %s is rank %d of %d in world version %d", s.config.worker_id, s.world.rank,
                 s.world.size, s.world.version)
    return s


def active() -> Optional[Session]:
    """The process's session, or None outside ``elastic.init()`` … ``shutdown()``."""
    return _session


def shutdown(success: Optional[bool] = True) -> None:
    """Ends this worker's session: ``True`` reports success, ``False`` leaves, ``None`` just closes.

    Its last world stays readable (``rank()``, ``size()`` …); collectives raise from here on."""
    global _session, _last
    with _lock:
        s, _session = _session, None
        if s is not None:
            _last = (s.config.job_id, s.world)
    if s is not None:
        s.shutdown(success)


def use_ring(comm: Optional[Communicator]) -> None:
    """Makes ``comm`` the ring the collectives run on while no session runs: for tools and
    tests that form a ring by hand from an explicit peer list (``Communicator.form``)."""
    global _ring
    with _lock:
        _ring = comm


def _current_ring() -> Optional[Communicator]:
    s = _session
    return s.comm if s is not None else _ring


def ring() -> Communicator:
    """The ring the collectives run on now; a clear error when there is none."""
    comm = _current_ring()
    if comm is not None:
        return comm
    last = _last
    if last is not None:
        raise RendezvousError(f"job {last[0]} has finished (elastic.run returned): collectives need a running "
                              "job; rank(), size() and world_version() still answer with its last world")
    raise RendezvousError("no ring: call elastic.init() (or run your function under @elastic.run) first")


def current_world() -> Optional[WorldInfo]:
    """The world this worker is in, or the last one it was in after the session ended; None
    before any (a worker that has not joined, or only uses a ring formed by hand)."""
    s = _session
    if s is not None:
        return s.world
    last = _last
    return last[1] if last is not None else None


# ---------------------------------------------------------------------- the commit boundary
def commit(state) -> None:
    """``state.commit()``: a snapshot in memory, then the boundary every rank agrees on."""
    state.take_snapshot()
    s = _session
    if s is not None:
        s.record_commit(state.commit_step)
    if state.checkpoint_due() and _rank_or_zero() == 0:
        state.write_checkpoint(wait_s=_durable_wait_s())  # written on the State's writer thread
    check_membership()


def _durable_wait_s() -> float:
    """How long a durable commit may wait for the previous write still running: half the
    collective timeout, so the other ranks, already in the boundary's allreduce, never take
    this live rank for a dead one."""
    comm = _current_ring()
    return (comm.config.timeout if comm is not None else CommConfig().timeout) / 2


def check_membership() -> None:
    """Raises MembershipChanged on every rank at once when a clean join/leave is pending, or
    when a rank was asked to leave; on that rank it raises ``Preempted`` after it left.

    One 8-byte allreduce (Max of [a change is pending, this rank wants to leave]): a rank that
    knows tells all the others, so they all switch at this same commit.
    """
    s = _session
    comm = ring()
    leaving = s is not None and s.leave.pending   # read once: what this rank tells the others
    flags = np.array([1 if s is not None and s.membership_pending() else 0, 1 if leaving else 0], dtype=np.int32)
    comm.allreduce_(flags, Max)
    if flags[1]:
        _farewell(comm)
        if leaving:
            raise s.depart()
        raise MembershipChanged(f"a worker leaves world version {comm.world_version}; re-forming without it")
    if flags[0]:
        raise MembershipChanged(f"membership of world version {comm.world_version} changed; re-forming")


def _farewell(comm: Communicator) -> None:
    """One barrier after the allreduce that announced a leave. When it completes on a leaver,
    every rank has the allreduce's result, so closing the leaver's ring then fails nobody's
    commit. A failure in it (a leaver closed first) is no failure of the commit: every rank
    agreed already, and this ring is not used again."""
    try:
        comm.barrier()
    except WorkerLostError as e:
        log.debug("farewell barrier of world version %d: %s", comm.world_version, e)


def request_leave(reason: str = "elastic.request_leave()") -> None:
    """Asks this worker to leave the job gracefully at its next commit boundary, as SIGTERM does
    under ``elastic.run``: for platforms that announce preemption another way (a metadata
    endpoint, a notice file). Safe from any thread; later calls change nothing. The grace
    (``ELASTIC_PREEMPT_GRACE``) runs from the first call. ``reason`` goes to the log lines."""
    s = _session
    if s is None:
        raise RendezvousError("elastic.request_leave(): no session: call it while elastic.run (or elastic.init()) "
                              "runs")
    s.leave.request(str(reason)[:200])


def sync(state) -> None:
    """Makes every rank hold the most advanced rank's commit (or rank 0's state before any).

    One allgather agrees on the highest commit step; that rank (the lowest of them), the root,
    sends its state, encoded by ``elastic.serialization``; every rank, the sender too, loads the
    same bytes, so all hold the same bits afterwards.

    Nothing the root sends is used before every rank has said it can take it: first its size
    (within the memory this machine has available), then its bytes (they decode, and fit this
    rank's state: ``State.check_shape``). After each, one small allgather of every rank's word,
    and ``judge_sync`` decides on every rank alike: all accepted, go on; else the root is blamed
    (it could not send, or most of the others refused) or the refusers are (a minority). The
    blamed raise ``SyncRefusedError`` (no later world fixes it), the others ``BadPeerError``
    naming one of them, so ``elastic.run`` reports it and the rendezvous evicts it; nobody loads
    anything, and the next world syncs from the best state among the rest.
    """
    comm = ring()
    steps = comm.allgather_equal(np.array([state.commit_step], dtype=np.int64))[:, 0]
    root = int(np.argmax(steps))  # the lowest rank among those with the highest step
    step = int(steps[root])
    encoded = failure = None
    if comm.rank == root:
        try:
            encoded = state.encode_for_sync(step, from_checkpoint=step < 0 and root == 0)
        except Exception as e:   # told to every rank below, then raised here
            failure = e
        size = np.array([encoded.nbytes if encoded is not None else _CANNOT_SEND], dtype=np.int64)
    else:
        size = np.zeros(1, dtype=np.int64)
    comm.broadcast_(size, root_rank=root)
    n = int(size[0])
    why = None
    if comm.rank != root:
        why = sync_size_problem(n, _memory_available())
        if why is not None:
            why = (f"rank {root}, which holds the most advanced commit ({step}), could not send its state; its own "
                   "error says why" if n == _CANNOT_SEND else f"rank {root} {why}")
    _agree(comm, root, step, why, own_error=failure)
    payload = np.empty(n, dtype=np.uint8)
    if comm.rank == root:
        encoded.copy_into(payload)
    comm.broadcast_(payload, root_rank=root)
    try:
        got_step, snapshot = state.decode_synced(payload, root, comm.world_version)
        why = None
    except Exception as e:   # whatever the root's bytes make the checks raise is the root's failure
        why = str(e)
    _agree(comm, root, step, why)
    try:
        state.adopt_synced(got_step, snapshot)
    except Exception as e:
        state.restore()
        raise SyncRefusedError(f"sync in world version {comm.world_version}: this rank could not load the state of "
                               f"rank {root} that every rank had checked ({type(e).__name__}: {e}); its last commit "
                               "is restored", world_version=comm.world_version, rank=comm.rank, peer=root) from e
    s = _session
    if s is not None:
        s.record_commit(got_step)
    torch_group = _torch_distributed()
    if torch_group is not None:   # DDP modules and the default group follow the new world
        torch_group.after_sync(state, root)


_CANNOT_SEND = -1   # what the root announces as its state's size when it cannot encode it


@dataclasses.dataclass(frozen=True)
class SyncVerdict:
    """What a world decided about one stage of a sync (every rank computes the same one)."""
    refused_by: Tuple[int, ...]   # ranks that did not accept (the root, when it could not send)
    blamed: Tuple[int, ...]       # () when all accepted; else the root alone, or the refusers


def judge_sync(root: int, accepted: Sequence[bool]) -> SyncVerdict:
    """Who is to blame in a sync stage where rank r said ``accepted[r]``. The root is blamed when
    it did not accept itself (it could not send) or when more of the other ranks refused than
    accepted: the bytes were the same for all, so most refusing means the bytes were bad. A
    minority that refused is blamed instead: what everyone else took does not fit its state.
    (Two ranks: the one that refused is believed.)"""
    refused = tuple(r for r, ok in enumerate(accepted) if not ok)
    if not refused:
        return SyncVerdict((), ())
    others_refused = sum(1 for r in refused if r != root)
    others_accepted = len(accepted) - 1 - others_refused
    if root in refused or others_refused > others_accepted:
        return SyncVerdict(refused, (root,))
    return SyncVerdict(refused, refused)


def sync_size_problem(size: int, available: int) -> Optional[str]:
    """Why a sync state of ``size`` bytes cannot be received here (None: it can): a size below
    zero, or more than the ``available`` bytes of memory this machine has now."""
    if size < 0:
        return f"announced a state of {size} bytes"
    if size > available:
        return f"announced a state of {size} bytes, more than the {available} bytes of memory available here"
    return None


def _memory_available() -> int:
    """Bytes of memory this machine can give now (MemAvailable; all of it when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _agree(comm: Communicator, root: int, step: int, why: Optional[str], own_error: Optional[Exception] = None) -> None:
    """One sync stage's verdict: every rank says whether it accepts (``why``: why not), and each
    raises what ``judge_sync`` decides for it, or returns when all accepted."""
    accepted = own_error is None and why is None
    words = comm.allgather_equal(np.array([1 if accepted else 0], dtype=np.int64))[:, 0]
    verdict = judge_sync(root, [w == 1 for w in words.tolist()])
    if not verdict.blamed:
        return
    version, me = comm.world_version, comm.rank
    where = dict(world_version=version, rank=me)
    if me in verdict.blamed:
        if own_error is not None:
            raise own_error
        others = [r for r in verdict.refused_by if r != me]
        if me == root:
            raise SyncRefusedError(f"sync in world version {version}: rank(s) {others} of {comm.size} refused the "
                                   f"state this rank sent as the most advanced (commit {step}); it does not fit "
                                   "theirs or cannot be received (their errors say why)", peer=root,
                                   refused_by=verdict.refused_by, **where)
        raise SyncRefusedError(f"sync in world version {version}: this rank refused the state rank {root} sent "
                               f"({why}), which the other ranks accepted: this worker's state does not fit the job's",
                               peer=root, refused_by=verdict.refused_by, **where)
    blamed = verdict.blamed[0]
    if why is None:
        why = (f"rank(s) {list(verdict.refused_by)} refused the state rank {root} sent" if blamed == root else
               f"rank {blamed} refused the state rank {root} sent, which the other ranks accepted: its state does not "
               "fit the job's")
    elif not why.startswith("sync in world version"):
        why = f"sync in world version {version}: {why}"
    raise BadPeerError(f"{why}; nothing was loaded", op="sync", peer=blamed, kind=ErrorKind.BadPeer, **where)


def _rank_or_zero() -> int:
    world = current_world()
    if world is not None:
        return world.rank
    comm = _ring
    return comm.rank if comm is not None else 0


# ---------------------------------------------------------------------- the current world
def _world(what: str) -> WorldInfo:
    world = current_world()
    if world is None:
        raise RendezvousError(f"elastic.{what}(): no world yet: call elastic.init() (or run your function under "
                              "@elastic.run) first")
    return world


def rank() -> int:
    """This worker's rank in the current world (after ``elastic.run`` returned: in its last world)."""
    return _world("rank").rank


def size() -> int:
    """Number of workers in the current world (after ``elastic.run`` returned: in its last world)."""
    return _world("size").size


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return _world("local_rank").local_rank


def local_size() -> int:
    """Number of workers on this worker's host."""
    return _world("local_size").local_size


def cross_rank() -> int:
    """This host's index among the hosts that have a worker with this worker's local rank."""
    return _world("cross_rank").cross_rank


def cross_size() -> int:
    """Number of hosts that have a worker with this worker's local rank."""
    return _world("cross_size").cross_size


def world_version() -> int:
    """Version of the current world; it grows with every membership change."""
    return _world("world_version").version
