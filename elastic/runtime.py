"""The worker's session with its job: ring listener, rendezvous client, and the event pump.

One ``Runtime`` per process (``elastic.init()`` creates it). The pump thread reads the
rendezvous events and is the only place that reacts to them while training code runs: an
abort notice, a superseding world or the end of the session aborts the ring in flight,
so a collective stuck on a stopped peer fails within milliseconds of the announcement; a
pending membership change is only recorded, for ``check_membership()`` to act on at a
commit boundary every rank agrees on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from rendezvous.client import Abort, Ended, Finished, JobSpec, Pending, RendezvousClient, Standby, WorldInfo
from rendezvous.client import RendezvousRPCError as _ClientError

from . import collectives
from .communicator import Communicator, Listener
from .config import WorkerConfig
from .errors import BadPeerError, RendezvousError, WorkerLostError

log = logging.getLogger("elastic")


class JobFinished(RendezvousError):
    """The job finished (another worker reported success, or it failed) while this worker waited."""

    def __init__(self, message: str, succeeded: bool):
        super().__init__(message)
        self.succeeded = succeeded


class Runtime:
    def __init__(self, config: WorkerConfig):
        self.config = config
        # Opened before rendezvous: its address is what this worker announces.
        self.listener = Listener(config.ring_host, 0)
        self.client = RendezvousClient(
            list(config.rendezvous), job_id=config.job_id, worker_id=config.worker_id, host=config.host,
            ring_address=self.listener.address, token=config.token,
            credentials=config.channel_credentials(),
            spec=JobSpec(min_np=config.min_np, max_np=config.max_np, elastic_timeout_s=config.elastic_timeout))
        self._cond = threading.Condition()
        self.comm: Optional[Communicator] = None   # the ring of `self.world`, formed or forming
        self.world: Optional[WorldInfo] = None
        self._latest: Optional[WorldInfo] = None   # newest announced world that includes this worker
        self._pending_version = -1                 # newest version with a clean change pending
        self._aborted_version = -1                 # newest version a member of which failed
        self._seen_version = 0                     # newest world version announced to this worker
        self._finished: Optional[Finished] = None
        self._ended: Optional[Ended] = None
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_loop, name="elastic-rendezvous-pump", daemon=True)
        self.committed_step = -1

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        try:
            self.client.join(committed_step=-1)
        except _ClientError as e:
            self.listener.close()
            raise RendezvousError(f"cannot join job {self.config.job_id!r} at {','.join(self.config.rendezvous)}: "
                                  f"{e}") from None
        self._pump.start()

    def shutdown(self, success: Optional[bool]) -> None:
        """Ends this worker's part: report success, or leave cleanly, and release everything."""
        self._stop.set()
        try:
            if success:
                self.client.report_success()
            elif success is False:
                self.client.leave()
        except _ClientError as e:
            if success and self._finished is not None:
                log.info("job already finished: %s", self._finished.reason)
            elif success and "already finished" in str(e):
                log.info("job already finished (another worker reported success first)")
            else:
                log.warning("could not tell the rendezvous server this worker %s: %s",
                            "succeeded" if success else "left", e)
        with self._cond:
            comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        collectives.set_communicator(None)
        self.client.close()
        self._pump.join(timeout=5)
        self.listener.close()

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
        comm = self.comm
        if isinstance(ev, WorldInfo):
            self._seen_version = max(self._seen_version, ev.version)
            # Same version with other members is a new world too (the client says so).
            if self._latest is None or ev.version > self._latest.version or \
                    (ev.version == self._latest.version and ev.members != self._latest.members):
                self._latest = ev
            if comm is not None and comm.world_version < ev.version and not self._formed:
                comm.abort(f"world version {comm.world_version} superseded by {ev.version} while forming")
        elif isinstance(ev, Pending):
            self._pending_version = max(self._pending_version, ev.world_version)
        elif isinstance(ev, Abort):
            self._aborted_version = max(self._aborted_version, ev.world_version)
            # An older ring that is waiting for a clean switch at its next commit is healthy:
            # an abort of the newer version it will switch to is not about it.
            older_pending = comm is not None and comm.world_version < ev.world_version and \
                self._pending_version >= comm.world_version
            if comm is not None and comm.world_version <= ev.world_version and not older_pending:
                comm.abort(f"rendezvous: {ev.reason}")
        elif isinstance(ev, Finished):
            self._finished = ev
            if not ev.succeeded and comm is not None:
                comm.abort(f"job failed: {ev.reason}")
        elif isinstance(ev, Ended):
            self._ended = ev
            if comm is not None:
                comm.abort(f"rendezvous session ended: {ev.reason}")
        elif isinstance(ev, Standby):
            log.info("worker %s is on standby: %s", self.config.worker_id, ev.reason)

    _formed = False

    # ------------------------------------------------------------------ worlds
    def membership_pending(self) -> bool:
        """True when a clean join/leave is waiting to take effect at the next commit."""
        with self._cond:
            if self.world is None:
                return False
            v = self.world.version
            return self._pending_version >= v or (self._latest is not None and self._latest.version > v)

    def next_world(self, min_version: int) -> WorldInfo:
        """Waits for the newest world (version >= min_version) that includes this worker."""
        deadline = time.monotonic() + self.config.world_timeout
        with self._cond:
            while True:
                if self._finished is not None:
                    raise JobFinished(f"job {self.config.job_id} finished: {self._finished.reason}",
                                      self._finished.succeeded)
                if self._ended is not None:
                    reason, outcome, self._ended = self._ended.reason, self._ended.finished, None
                    if outcome is not None:  # e.g. evicted while stopped, woken after the end
                        raise JobFinished(f"job {self.config.job_id} finished without worker "
                                          f"{self.config.worker_id}: {reason}", outcome)
                    log.warning("session of worker %s ended (%s); joining again as a new member",
                                self.config.worker_id, reason)
                    self._latest = None
                    self._cond.release()
                    try:
                        self.client.join(committed_step=self.committed_step)
                    except _ClientError as e:
                        outcome = e.finished
                        if outcome is not None:
                            raise JobFinished(f"job {self.config.job_id} finished without worker "
                                              f"{self.config.worker_id}: {e}", outcome) from None
                        raise RendezvousError(f"cannot rejoin job {self.config.job_id}: {e}") from None
                    finally:
                        self._cond.acquire()
                    # Joining as a new member makes a new world: never take one seen before.
                    min_version = self._seen_version + 1
                    continue
                w = self._latest
                if w is not None and w.version >= min_version:
                    return w
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousError(
                        f"worker {self.config.worker_id} of job {self.config.job_id}: no world (version >= "
                        f"{min_version}) included it within {self.config.world_timeout:g} s")
                self._cond.wait(min(left, 1.0))

    def form(self, world: WorldInfo) -> Communicator:
        """Forms the ring of ``world``; raises WorkerLostError if it is aborted or superseded meanwhile."""
        # The job's random secret, from the server's answer to this worker's Join.
        comm = Communicator.create(listener=self.listener, job_id=self.config.job_id,
                                   secret=self.client.ring_secret, world_version=world.version, rank=world.rank,
                                   peers=[m.ring_address for m in world.members],
                                   hosts=[m.host for m in world.members],  # same host: shared memory
                                   config=self.config.comm)
        with self._cond:
            old, self.comm, self.world, self._formed = self.comm, comm, world, False
            superseded = (self._aborted_version >= world.version
                          or (self._latest is not None and self._latest.version > world.version))
        if old is not None:
            old.close()
        if superseded:
            comm.abort(f"world version {world.version} was superseded before it formed")
        collectives.set_communicator(comm)
        comm.connect()
        with self._cond:
            self._formed = True
            if self._aborted_version >= world.version:
                comm.abort(f"world version {world.version} was aborted while forming")
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
                                                 unusable_address=isinstance(err, BadPeerError))
            log.info("reported %s (world %d): %s", suspect, world.version,
                     "evicted" if evicted else "still alive")
        except _ClientError as e:
            log.warning("could not report failed peer %s: %s", suspect, e)

    def record_commit(self, step: int) -> None:
        self.committed_step = step


# ---------------------------------------------------------------------- process-wide session
_runtime: Optional[Runtime] = None
_runtime_lock = threading.Lock()


def init(config: Optional[WorkerConfig] = None, *, form: bool = True) -> Runtime:
    """Joins the job and (unless ``form=False``) forms the ring of the first world that
    includes this worker.

    Idempotent: later calls return the same session. Reads the environment the launcher
    sets (see ``elastic.config``) unless ``config`` is given. ``elastic.run`` joins with
    ``form=False`` and forms inside its recovery loop, so a failure while the first ring
    forms is handled like any other.
    """
    global _runtime
    with _runtime_lock:
        rt = _runtime
        if rt is None:
            rt = Runtime(config or WorkerConfig.from_env())
            rt.start()
            _runtime = rt
    if form and rt.world is None:
        rt.form(rt.next_world(1))
        log.info("worker %s is rank %d of %d in world version %d", rt.config.worker_id, rt.world.rank,
                 rt.world.size, rt.world.version)
    return rt


def current() -> Runtime:
    rt = _runtime
    if rt is None or rt.world is None:
        raise RendezvousError("elastic.init() has not been called (or run your function under @elastic.run)")
    return rt


def shutdown(success: Optional[bool] = True) -> None:
    """Ends this worker's session: ``True`` reports success, ``False`` leaves, ``None`` just closes."""
    global _runtime
    with _runtime_lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        rt.shutdown(success)


def rank() -> int:
    """This worker's rank in the current world."""
    return current().world.rank


def size() -> int:
    """Number of workers in the current world."""
    return current().world.size


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return current().world.local_rank


def local_size() -> int:
    """Number of workers on this worker's host."""
    return current().world.local_size


def cross_rank() -> int:
    return current().world.cross_rank


def cross_size() -> int:
    return current().world.cross_size


def world_version() -> int:
    """Version of the current world; it grows with every membership change."""
    return current().world.version
