"""The step protocol on one ring: commit, membership check and sync, and the hooks of the layers above.

A ``Session`` is the one owner of the step protocol; the process holds one (``elastic.runtime.
current``). A ``JobSession`` (``elastic.runtime.job_session``) is joined to a job: it forms the
ring of each world the rendezvous announces and runs ``elastic.run``'s loop. A plain ``Session``
runs a ring formed by hand (tools, tests): the same commit, check and sync, with no membership
change ever pending. This docstring is the one description of the protocol; other modules point
here.

The step protocol (``JobSession.run``, what ``elastic.run`` runs)::

    join -> form the ring of the next world -> compare what the last ring failed in (``elastic.runtime.
    divergence``) -> [world_changed] -> reset callbacks -> sync -> func(state)
    func calls state.commit(): snapshot (+ durable write, rank 0, every n-th) -> [committed]
                               -> membership check (one collective every rank agrees on)
    an error ends func, a form or a sync; ``reaction.after_error`` plans what comes next and
    ``JobSession.recover`` carries the plan out:
      a peer failed (WorkerLostError)        : restore the last commit, report the suspect, next world
      a stale neighbour (HandshakeError)     : restore, next world
        (both keep the live state instead where the State can: ``State.live_state_usable``; the sync
        then takes the most advanced rank's, so survivors that stood at different steps agree)
      different collectives (CollectiveMismatchError): restore, report the sender, next world, whose
        first collective compares what every rank called: the majority blames the odd rank (none:
        every rank ends)
      a clean join/leave (MembershipChanged) : keep the state, next world (at a commit every rank agrees on)
      asked to leave (SIGTERM, SIGINT, request_leave): leave at the next commit, raise LeftJob
    sync: [before_sync] -> the most advanced rank's state to everyone (``elastic.state.sync``)
          -> [after_sync]

- **commit** (``commit``): the State takes its snapshot (and hands every ``checkpoint_every``-th
  commit to its durable writer on rank 0); the session records the commit step (its pump reports
  it to the rendezvous, which makes the most advanced worker rank 0 of the next world), runs the
  ``committed`` hooks, then ``check_membership``. The world is asked once: the ring of the commit.
- **membership check** (``check_membership``): one small allgather of every rank's own row [the
  world version it saw a change announced for, whether it leaves, its straggler timings]
  (``elastic.runtime.boundary``, ``elastic.runtime.straggler_detector``), judged alike on every
  rank: a change takes effect when a majority saw the server announce it, a leave when the leaver
  says so, and a row no honest worker writes blames its rank (``BadPeerError``). So every rank
  switches at this same commit, and no rank decides for the others. A leave request
  (``elastic.runtime.preemption``) is carried out here: the leaver calls the rendezvous Leave,
  closes its ring and ends ``elastic.run`` with ``LeftJob``; the others raise MembershipChanged
  and form the next world without it, their state kept.
- **sync** (``sync``): every rank ends holding the same bits, the commit of the most advanced
  rank (or rank 0's state before any); how: ``State.sync_over``, ``elastic.state.sync``.

A ``State`` only takes, encodes and adopts snapshots; when it does is decided here. Hooks
(``elastic.runtime.hooks``): the layers above the ring hand the session a ``StepHooks`` when its
run starts; each hook runs on every rank of the world at the same point, in the order added:
``run_starting`` before the first world; ``world_changed`` after each new world's ring formed,
before the reset callbacks and the sync (rebuild what depends on the world: a ``DeviceMesh``, an
FSDP model); ``before_sync``/``after_sync`` around every sync, on its ring (DDP rebuilds its
reducers after it); ``committed`` after each commit's snapshot, before its membership check, on the
ring of the commit (collectives allowed).

A ring failure that a layer above turned into another exception (torch makes a ``RuntimeError``
of a failed DDP comm hook) is noted here (``note_failure``); the loop raises that failure instead.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional, Tuple, Union

from rendezvous.client.watch_events import WorldInfo

from rendezvous.wire.membership import Blame

from elastic.ring.communicator import Communicator
from elastic.ring.errors import BadPeerError, CollectiveMismatchError, ErrorKind, WorkerLostError
from elastic.ring.wait_clock import WaitClock
from elastic.runtime import boundary, divergence, straggler_detector
from elastic.runtime.completions import Completions
from elastic.runtime.errors import LeftJob, MembershipChanged, RendezvousError
from elastic.runtime.commit_watch import CommitWatch
from elastic.runtime.hooks import StepHooks
from elastic.runtime.worker_metrics import Recorder, timed

log = logging.getLogger("elastic")


class Session:
    """The step protocol on the ring ``ring()`` gives (see the module doc). Made as it is, it
    serves a ring formed by hand: no change is ever pending, no leave requested, nothing reported."""

    def __init__(self, comm: Optional[Communicator] = None, *, job_id: str = "") -> None:
        self.job_id = job_id
        self.comm: Optional[Communicator] = comm   # the ring of ``world`` (formed or forming); None: none held
        self.world: Optional[WorldInfo] = None      # the world this worker is in (or was in, once ended)
        self.ended = False                          # ended: collectives raise, but on a ring kept after the run
        self.hooks: List[StepHooks] = []
        self.wait_clock = comm.wait_clock if comm is not None else WaitClock()   # every ring's waits count here
        self.metrics: Optional[Recorder] = None     # the worker's counters, when its launcher collects them
        self.straggler_detector: Optional[straggler_detector.Detector] = None   # rides on check_membership
        self.commit_step = -1                       # the commit the state holds now (taken or synced)
        self.state: Any = None                      # the State elastic.run runs in this session
        self.completions = Completions()            # async allreduces completed in order (DDP's buckets)
        self._lock = threading.Lock()
        self._failure: Optional[Union[WorkerLostError, CollectiveMismatchError]] = None
        self._sync_clock: Optional[Tuple[Communicator, Any]] = None   # opened by start_sync_clock
        # Warns (rank 0) when training goes long without a commit; JobSession sets its limits.
        self.commit_watch = CommitWatch(warn=self._warn_on_rank_0)
        self.stepped_world = 0                      # the newest world it trained in (note_progress)
        # What this rank's last ring failed in, compared in the next world (record_failure), and
        # the world whose comparison passed last: only a failure of a world it trained in counts.
        self.failed_record: Optional[divergence.Record] = None
        self.compared_world = 0

    # ------------------------------------------------------------------ where this worker is
    def ring(self, what: str = "") -> Communicator:
        """The ring the collectives run on now; a clear error when there is none."""
        comm = self.comm
        if comm is not None:
            self.commit_watch.check(self.commit_step)   # a monotonic read: every collective may
            return comm
        doing = f"{what}: " if what else ""
        if self.ended:
            raise RendezvousError(f"{doing}job {self.job_id} has finished and this worker's ring is closed "
                                  "(elastic.run returned without this worker's function completing, or "
                                  "dist.destroy_process_group() or elastic.shutdown() ran): rank(), size() and "
                                  "world_version() still answer with its last world")
        raise RendezvousError(f"{doing}no ring yet: call it inside the function @elastic.run runs (or after "
                              "elastic.init())")

    def position(self) -> Optional[Tuple[int, int]]:
        """(rank, size) of this worker: in its world (its last one once ended), else on the ring
        it holds (formed by hand); None before either."""
        if self.world is not None:
            return self.world.rank, self.world.size
        comm = self.comm
        return (comm.rank, comm.size) if comm is not None else None

    def add_hooks(self, hooks: StepHooks) -> None:
        """``hooks`` run at the protocol's points from now on (once, however often added)."""
        with self._lock:
            if not any(h is hooks for h in self.hooks):
                self.hooks = self.hooks + [hooks]

    def remove_hooks(self, hooks: StepHooks) -> None:
        with self._lock:
            self.hooks = [h for h in self.hooks if h is not hooks]

    # ------------------------------------------------------------------ what a job session answers
    def membership_pending(self) -> bool:
        """True when a clean join/leave is waiting to take effect at the next commit."""
        return False

    def heard_claims(self, comm: Communicator, claimers: Tuple[int, ...]) -> None:
        """The ranks of ``comm`` that said, at this commit, that a change is pending (a job
        session checks a claim it does not see confirmed)."""

    def expect_leave(self, comm: Communicator, leavers: Tuple[int, ...]) -> None:
        """The ranks of ``comm`` that said, at this commit, that they leave (a job session checks
        that they do)."""

    def leave_pending(self) -> bool:
        """True when this worker was asked to leave (at its next commit)."""
        return False

    def depart(self) -> LeftJob:
        raise RendezvousError("only a session joined to a job can leave it")

    # ------------------------------------------------------------------ the protocol
    def timed(self, state: Any, what: str) -> Any:
        """Times a commit or a sync into this session's metrics (nothing without metrics)."""
        return timed(self.metrics, state, what)

    def commit(self, state: Any) -> None:
        """``state.commit()``: the snapshot (and durable copy), then the boundary every rank agrees on."""
        comm = self.ring("commit")
        with self.timed(state, "commit"):
            # A durable write waits at most half the collective timeout for the one before, so
            # the other ranks, already in the boundary's allreduce, never take this rank for dead.
            state.take_commit(durable=comm.rank == 0, wait_s=comm.config.timeout / 2)
            self.note_progress()   # a commit in this world: it trains here (a state that counts no steps)
            self.boundary(state, state.commit_step, comm)

    def boundary(self, state: Any, commit_step: int, comm: Communicator) -> None:
        """Commit ``commit_step`` is taken: recorded, the ``committed`` hooks, the membership check."""
        self.record_commit(commit_step)
        for h in self.hooks:
            h.committed(state, commit_step)
        self.check_membership(comm)

    def record_commit(self, commit_step: int) -> None:
        """The state holds commit ``commit_step`` now (taken or synced)."""
        self.commit_step = commit_step
        self.commit_watch.committed()

    def stepped(self) -> None:
        """A training step completed (a ``TorchState``'s optimizer stepped and its batch was done)."""
        self.commit_watch.stepped(self.commit_step)
        self.note_progress()

    def note_progress(self) -> None:
        """This worker trained in its current world: a step completed, or a commit taken in it."""
        if self.world is not None:
            self.stepped_world = self.world.world_version

    def _warn_on_rank_0(self, text: str) -> None:
        where = self.position()
        if where is None or where[0] == 0:   # one line for the job, not one per worker
            log.warning("%s", text)

    def check_membership(self, comm: Optional[Communicator] = None) -> None:
        """Raises MembershipChanged on every rank at once when a clean join/leave is pending, or
        when a rank was asked to leave; on that rank it raises ``LeftJob`` after it left; raises
        ``BadPeerError`` naming a rank whose row no honest worker writes.

        One small allgather of every rank's own row (``elastic.runtime.boundary``): the change
        this rank saw announced, whether it leaves, its compute and wait seconds since the last
        window (``elastic.runtime.straggler_detector``). Every rank judges the same rows alike, so
        they all switch at this same commit, on what the majority saw, not on one rank's word.
        """
        comm = comm if comm is not None else self.ring("check_membership")
        leaving = self.leave_pending()   # read once: what this rank tells the others
        detector = self.straggler_detector
        compute, wait = detector.timings(comm) if detector is not None else (0.0, 0.0)
        pending = comm.world_version if self.membership_pending() else 0
        rows = comm.allgather_equal(boundary.row(pending, leaving, compute, wait))
        check = boundary.judge(rows, comm.world_version,
                               detector.window_wall(comm) if detector is not None else None)
        if check.blamed:
            raise _impossible_row(comm, check.blamed)
        self.heard_claims(comm, check.claimers)
        if detector is not None:
            detector.judge(check.compute, check.wait, comm)
        if check.leavers:
            _farewell(comm)
            if leaving:
                raise self.depart()
            self.expect_leave(comm, check.leavers)
            raise MembershipChanged(f"rank(s) {', '.join(map(str, check.leavers))} leave world version "
                                    f"{comm.world_version}; re-forming without them")
        if check.switch:
            raise MembershipChanged(f"membership of world version {comm.world_version} changed; re-forming")

    def check_return(self) -> bool:
        """The last collective of a rank whose training function returned: its membership row once
        more, saying so (``elastic.runtime.boundary``). True when every rank's function returned
        at this same point (the world's success). False when the others train on: their next
        collective met this one, as a commit's check (they then see this rank leave, and it says
        farewell as a leaver does) or as another collective (this raises, a mismatch or a lost
        peer). The caller leaves the world either way but the first."""
        comm = self.comm
        if comm is None or comm.failed:
            return False
        rows = comm.allgather_equal(boundary.row(0, False, returned=True))
        check = boundary.judge(rows, comm.world_version, None)
        if check.done:
            return True
        if check.blamed:
            raise _impossible_row(comm, check.blamed)
        _farewell(comm)
        return False

    def record_failure(self, error: BaseException, ring_world_version: int) -> None:
        """Keeps what the ring of ``ring_world_version`` failed in on this rank (the collective,
        or none: it was computing), for the next world's comparison (``elastic.runtime.divergence``).
        Only a world whose comparison passed (it trained there) counts: a failure to form, to
        check the ring's settings, or of the comparison itself keeps the record there is."""
        if isinstance(error, (WorkerLostError, CollectiveMismatchError)) and ring_world_version > 0 \
                and error.world_version == ring_world_version == self.compared_world \
                and not getattr(error, "decided", False):
            self.failed_record = divergence.Record(ring_world_version, isinstance(error, CollectiveMismatchError),
                                                   error.call)

    def name_rank(self, rank: int) -> str:
        """``worker W (rank R)`` for rank ``rank`` of this worker's world; ``rank R`` outside its view."""
        member = self.world.peer(rank) if self.world is not None else None
        return f"worker {member.worker_id} (rank {rank})" if member is not None else f"rank {rank}"

    def check_divergence(self, comm: Communicator) -> None:
        """The first collective on every ring a job session forms, after its settings check and
        before any layer sees the world: every rank's record of what its last ring failed in,
        compared (``elastic.runtime.divergence``). Raises the verdict's error when a rank
        diverged or no call is the majority's; the record stays until a comparison passes."""
        if comm.size > 1:
            rows = comm.allgather_equal(divergence.encode(self.failed_record))
            verdict = divergence.judge([divergence.decode(row) for row in rows], comm.world_version)
            if not isinstance(verdict, divergence.Nothing):
                error = divergence.verdict_error(verdict, comm.rank, comm.world_version, self.name_rank)
                if error is not None:
                    raise error
        self.failed_record = None
        self.compared_world = comm.world_version

    def sync(self, state: Any) -> None:
        """Makes every rank hold the most advanced rank's commit (or rank 0's state before any)."""
        comm = self.ring("sync")
        clock = self._take_sync_clock(state, comm)
        try:
            for h in self.hooks:
                h.before_sync(state)
            root, commit_step = state.sync_over(comm)
            self.record_commit(commit_step)
            self.clear_failure()
            for h in self.hooks:   # the torch group and DDP follow the new world
                h.after_sync(state, root)
        except BaseException as e:
            clock.__exit__(type(e), e, e.__traceback__)
            raise
        clock.__exit__(None, None, None)

    def start_sync_clock(self, state: Any, comm: Communicator) -> None:
        """The sync of ``comm``'s world is timed from now: a layer that begins the sync's work as
        the world changes (a sharded state reshards there) counts that work in."""
        clock = self.timed(state, "sync")
        clock.__enter__()
        self._sync_clock = (comm, clock)

    def _take_sync_clock(self, state: Any, comm: Communicator) -> Any:
        started, self._sync_clock = self._sync_clock, None
        if started is not None and started[0] is comm:
            return started[1]
        clock = self.timed(state, "sync")   # a clock of an earlier world was never closed: it counts nothing
        clock.__enter__()
        return clock

    def abort_ring(self, reason: str, comm: Optional[Communicator] = None) -> None:
        """Aborts ``comm`` (default: the ring held): whatever is in flight on it fails on every rank
        within milliseconds; then every layer aborts what it runs behind the ring (``ring_aborted``)."""
        comm = comm if comm is not None else self.comm
        if comm is None:
            return
        comm.abort(reason)
        for h in self.hooks:
            try:
                h.ring_aborted(reason)
            except Exception:  # noqa: BLE001 (the event thread must outlive a layer's failure)
                log.exception("a layer failed to abort its work behind the ring: %s", reason)

    # ------------------------------------------------------------------ failures a layer above caught
    def note_failure(self, err: Union[WorkerLostError, CollectiveMismatchError]) -> None:
        """A ring failure (or mismatch) that a layer above turned into another error (torch makes
        a ``RuntimeError`` of a failed DDP comm hook): ``noted_failure`` gives it back."""
        with self._lock:
            if self._failure is None or err.world_version >= self._failure.world_version:
                self._failure = err

    def noted_failure(self) -> Optional[Union[WorkerLostError, CollectiveMismatchError]]:
        """The ring failure noted for the ring held now (or for none): what the loop raises in
        place of the error that escaped the training function."""
        with self._lock:
            err = self._failure
        if err is None:
            return None
        comm = self.comm
        if comm is None or comm.failed or comm.world_version <= err.world_version:
            return err
        return None

    def clear_failure(self) -> None:
        with self._lock:
            self._failure = None

    # ------------------------------------------------------------------ the ring kept after the run
    def close_ring(self) -> None:
        """Closes the ring this session holds, if any (``dist.destroy_process_group()``, the next
        ``elastic.init()``, the exit)."""
        with self._lock:
            comm, self.comm = self.comm, None
        if comm is not None:
            self.release_ring(comm)

    def release_ring(self, comm: Communicator) -> None:
        """Closes ``comm``, a ring this session held and let go of, and tells every layer (``ring_closed``)."""
        comm.close()
        for h in self.hooks:
            try:
                h.ring_closed()
            except Exception:  # noqa: BLE001 (closing must complete whatever a layer does)
                log.exception("a layer failed to release what it runs behind the ring")

    def end(self) -> None:
        """This session is over: its last world still answers; the ring it holds stays only for
        collectives after the run (``close_ring`` closes it)."""
        self.ended = True


def _impossible_row(comm: Communicator, blamed: Tuple[Tuple[int, str], ...]) -> BadPeerError:
    """What every rank raises when the membership check's rows hold one no honest worker writes:
    a ``BadPeerError`` naming the first such rank (``elastic.run`` reports it; the majority's
    reports evict it). The rank blamed raises it too, naming itself: it reports nothing."""
    rank, why = blamed[0]
    others = f" (and rank(s) {', '.join(str(r) for r, _ in blamed[1:])})" if len(blamed) > 1 else ""
    return BadPeerError(f"check_membership in world version {comm.world_version}: rank {rank} wrote {why} into its "
                        f"row of the membership check{others}; no worker measures that", op="check_membership",
                        world_version=comm.world_version, rank=comm.rank, peer=rank, kind=ErrorKind.BadPeer,
                        blame=Blame.IMPOSSIBLE_ROW)


def _farewell(comm: Communicator) -> None:
    """One barrier after the allreduce that announced a leave. When it completes on a leaver,
    every rank has the allreduce's result, so closing the leaver's ring then fails nobody's
    commit. A failure in it (a leaver closed first) is no failure of the commit: every rank
    agreed already, and this ring is not used again."""
    try:
        comm.barrier()
    except WorkerLostError as e:
        log.debug("farewell barrier of world version %d: %s", comm.world_version, e)
