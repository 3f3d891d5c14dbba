"""One world's device communicator as the elastic group and DDP use it: collectives started, watched, aborted.

A ``WorldDevice`` holds the ``DeviceBackend`` of one world version (``elastic.torchdist.
device_backend``) and is the only way to it:

* ``run`` starts a collective, unless the communicator was aborted (then it raises that world's
  ``WorkerLostError`` at once: nothing is started on a dead communicator), and watches it.
* The watcher thread waits for the collectives in the order they were started (one stream: they
  finish in that order), without the GIL, and hands each finished one on (DDP's bucket futures).
* The deadline thread applies the collective timeout (``ELASTIC_COLLECTIVE_TIMEOUT``) to the
  oldest collective in flight, as the ring does to its own: past it, the world fails with a
  ``WorkerLostError`` of kind ``Timeout`` that blames the next rank round the ring (the rank a
  ring collective would wait on), which the rendezvous then probes: a live one keeps its place
  and the world re-forms with the same members, a dead one is evicted. A collective that fails
  (NCCL found a peer gone) fails the world the same way, blaming nobody.
* ``abort`` (on any world change, from a side thread) marks the communicator dead first, fails
  what waits on it, then aborts the backend on a thread of its own; when that does not return
  within ``ELASTIC_DEVICE_ABORT_TIMEOUT`` seconds the worker writes one line and exits with
  ``DEVICE_ABORT_STUCK_EXIT`` (``elastic.runtime.worker_config``), a status elastic-run
  respawns: a job never hangs on a stuck abort.

The flag comes before the backend's abort, so whoever sees a collective end after an abort (its
kernel cut short, its result garbage) also sees the flag: ``error`` tells every reader the
world's result is not to be trusted.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Deque, List, Optional

from elastic.ring.errors import ErrorKind, WorkerLostError
from elastic.runtime.worker_config import DEVICE_ABORT_STUCK_EXIT
from elastic.torchdist.device_backend import DeviceBackend

log = logging.getLogger("elastic")

Done = Callable[[Optional[BaseException]], None]


def abort_within(abort: Callable[[], None], bound: float, what: str,
                 exit_now: Callable[[int], None] = os._exit) -> threading.Thread:
    """Runs ``abort()`` on a thread of its own and returns that thread; when it has not returned
    after ``bound`` seconds, writes one line naming ``what`` and calls ``exit_now`` with
    ``DEVICE_ABORT_STUCK_EXIT`` (the process ends: its launcher respawns it)."""
    returned = threading.Event()

    def run() -> None:
        try:
            abort()
        except Exception:  # noqa: BLE001 (an abort that fails has still returned)
            log.exception("aborting %s failed", what)
        finally:
            returned.set()

    def guard() -> None:
        if returned.wait(bound):
            return
        line = (f"elastic: aborting {what} did not return within {bound:g} s (ELASTIC_DEVICE_ABORT_TIMEOUT); "
                f"this worker exits with status {DEVICE_ABORT_STUCK_EXIT} to be replaced\n")
        try:
            sys.stderr.flush()
            os.write(2, line.encode())
        finally:
            exit_now(DEVICE_ABORT_STUCK_EXIT)

    worker = threading.Thread(target=run, name="elastic-device-abort", daemon=True)
    worker.start()
    threading.Thread(target=guard, name="elastic-device-abort-guard", daemon=True).start()
    return worker


@dataclasses.dataclass
class Pending:
    """A collective in flight: torch's work, what it is, when it must have finished, who waits."""

    work: Any
    what: str
    deadline: float
    callbacks: List[Done] = dataclasses.field(default_factory=list)   # run once, with its error or None
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[BaseException] = None


Failed = Callable[["WorldDevice", WorkerLostError, bool], None]   # (device, error, blame: report the peer)


class WorldDevice:
    """The device communicator of one world version (see the module doc)."""

    def __init__(self, backend: DeviceBackend, *, collective_timeout: float, abort_timeout: float,
                 failed: Failed, exit_now: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.collective_timeout = collective_timeout
        self.abort_timeout = abort_timeout
        self._failed_callback = failed
        self._exit_now = exit_now
        self._clock = clock
        self._lock = threading.Lock()          # a collective starting and an abort do not interleave
        self._cond = threading.Condition()     # guards _pending, _stopped
        self._pending: Deque[Pending] = collections.deque()
        self._stopped = False
        self._threads: List[threading.Thread] = []
        self._aborted = threading.Event()
        self.error: Optional[WorkerLostError] = None
        self.abort_thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ what it is
    @property
    def world_version(self) -> int:
        return self.backend.world_version

    @property
    def device_type(self) -> str:
        return self.backend.device_type

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def wait_aborted(self, timeout: float) -> bool:
        """Whether it was aborted within ``timeout`` seconds (at once when it has been)."""
        return self._aborted.wait(timeout)

    def _lost(self, message: str, kind: ErrorKind = ErrorKind.Aborted, peer: int = -1, op: str = "") -> WorkerLostError:
        return WorkerLostError(f"{self.backend.name} communicator of world version {self.world_version}: {message}",
                               op=op, world_version=self.world_version, rank=self.backend.rank, peer=peer, kind=kind)

    def check(self, what: str = "") -> None:
        """Raises the world's ``WorkerLostError`` once it was aborted or failed."""
        if self._aborted.is_set():
            raise self.error if self.error is not None else self._lost("aborted", op=what)

    # ------------------------------------------------------------------ collectives
    def connect(self) -> None:
        """Connects the world's communicator (every rank); an abort meanwhile raises ``WorkerLostError``."""
        self.check("connect")
        try:
            self.backend.connect()
        except Exception as e:
            if self._aborted.is_set():
                raise self.error or self._lost("aborted while connecting") from e
            raise
        self.check("connect")

    def run(self, what: str, method: str, *args: Any, done: Optional[Done] = None) -> Pending:
        """Starts ``method(*args)`` on the backend and watches it (``done(error)`` when it ended)."""
        with self._lock:
            self.check(what)
            try:
                work = self.backend.run(method, *args)
            except Exception as e:
                if self._aborted.is_set():
                    raise self.error or self._lost("aborted", op=what) from e
                raise
        return self.watch(work, what, done)

    def watch(self, work: Any, what: str, done: Optional[Done] = None) -> Pending:
        entry = Pending(work, what, self._clock() + self.collective_timeout, [done] if done is not None else [])
        with self._cond:
            if not self._stopped:
                self._pending.append(entry)
                self._start_threads()
                self._cond.notify_all()
                return entry
        self._finish(entry, self.error or self._lost("aborted", op=what))   # aborted meanwhile
        return entry

    def when_done(self, entry: Pending, done: Done) -> None:
        """``done(error)`` once ``entry`` ended (at once when it has)."""
        with self._cond:
            if not entry.finished.is_set():
                entry.callbacks.append(done)
                return
        done(entry.error)

    def _finish(self, entry: Pending, error: Optional[BaseException]) -> None:
        with self._cond:
            entry.error = error
            entry.finished.set()
            callbacks, entry.callbacks = entry.callbacks, []
        for done in callbacks:
            try:
                done(error)
            except Exception:  # noqa: BLE001 (the watcher must outlive a waiter's failure)
                log.exception("handing on the result of %s failed", entry.what)

    def wait(self, entry: Pending) -> None:
        """What ``Work.wait()`` of a collective run here does. On a CUDA device it orders the
        caller's stream after the collective (torch's NCCL semantics: the CPU goes on); on the
        CPU (gloo) it blocks until the watcher saw it end. Raises the world's error once known."""
        if self.device_type == "cuda":
            try:
                entry.work.wait()
            except Exception as e:
                raise self.error or self._lost(f"{entry.what} failed: {e}", kind=ErrorKind.PeerLost,
                                               op=entry.what) from e
        else:
            entry.finished.wait()
        if entry.error is not None:
            raise entry.error
        self.check(entry.what)

    def _start_threads(self) -> None:
        if not self._threads:
            for target, name in ((self._watch_loop, "elastic-device-watch"),
                                 (self._deadline_loop, "elastic-device-deadline")):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)

    # Each loop calls a step that holds the collective it looks at only while it runs: a thread
    # idle between collectives holds no torch ``Work``. Dropping one releases the GIL in its
    # destructor, and a daemon thread that takes the GIL back while the interpreter finalizes is
    # ended inside that destructor: the process aborts (std::terminate). ``close`` joins both.
    def _watch_loop(self) -> None:
        while self._watch_next():
            pass

    def _watch_next(self) -> bool:
        """Waits for the oldest collective and hands it on; False once the watcher is done."""
        with self._cond:
            while not self._pending and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return False
            entry = self._pending[0]
        error: Optional[BaseException] = None
        try:
            self.backend.finish(entry.work)
        except Exception as e:  # noqa: BLE001 (a failed collective fails the world, below)
            error = e
        with self._cond:
            if self._stopped:   # aborted meanwhile: abort() failed what waited
                return False
            if error is None:
                self._pending.popleft()
        if error is not None:
            self._fail(self._lost(f"{entry.what} failed: {error}", kind=ErrorKind.PeerLost, op=entry.what),
                       blame=False)
            return False
        with self.backend.completion():
            self._finish(entry, None)
        return True

    def _deadline_loop(self) -> None:
        while self._deadline_next():
            pass

    def _deadline_next(self) -> bool:
        """Waits until the oldest collective is due (or a while); False once the world failed or stopped."""
        with self._cond:
            if self._stopped:
                return False
            if not self._pending:
                self._cond.wait()
                return True
            entry = self._pending[0]
            left = entry.deadline - self._clock()
            if left > 0:
                del entry   # not held while it waits
                self._cond.wait(min(left, 1.0))
                return True
        peer = (self.backend.rank + 1) % self.backend.size if self.backend.size > 1 else -1
        self._fail(self._lost(f"{entry.what} did not finish within {self.collective_timeout:g} s "
                              f"(ELASTIC_COLLECTIVE_TIMEOUT) waiting on rank {peer}", kind=ErrorKind.Timeout,
                              peer=peer, op=entry.what), blame=True)
        return False

    def _fail(self, error: WorkerLostError, blame: bool) -> None:
        """A collective failed or timed out: the world is lost. The device is aborted first (so
        nothing waits on it), then the session hears of it (``failed``)."""
        if self._aborted.is_set():
            return
        log.warning("%s", error)
        self.abort(str(error), error)
        self._failed_callback(self, error, blame)

    # ------------------------------------------------------------------ the end
    def abort(self, reason: str, error: Optional[WorkerLostError] = None) -> Optional[threading.Thread]:
        """Marks the world's communicator dead, fails what waits on it, and aborts the backend on a
        thread of its own within the bound (see the module doc). Idempotent; returns that thread."""
        with self._cond:
            if self._aborted.is_set():
                return self.abort_thread
            self.error = error or self._lost(f"aborted ({reason})")
            self._aborted.set()   # before the backend's abort: see the module doc
            self._stopped = True
            waiting, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for entry in waiting:
            self._finish(entry, self.error)
        started = time.monotonic()
        what = f"the {self.backend.name} communicator of world version {self.world_version}"

        def run() -> None:
            with self._lock:   # a collective being started finishes starting first
                self.backend.abort()
            log.info("device backend %s of world version %d aborted in %.3f s (%s)", self.backend.name,
                     self.world_version, time.monotonic() - started, reason)

        self.abort_thread = abort_within(run, self.abort_timeout, what, self._exit_now)
        return self.abort_thread

    def close(self, reason: str) -> List[threading.Thread]:
        """The world is over (a new one formed, or the ring closed): aborted (every world change
        aborts its communicator, so nothing of it outlives the world), then dropped; returns the
        threads still running: the one releasing the backend (``DeviceBackend.close``), and the
        watcher when a collective it waits on cannot be cut short (gloo). The process must not
        exit while they run (see ``_watch_loop``)."""
        thread = self.abort(reason)
        if thread is not None:
            thread.join(self.abort_timeout)   # past the bound the guard ends the process
        deadline = time.monotonic() + self.abort_timeout
        for t in self._threads:   # they return once stopped, dropping what they held
            t.join(max(0.0, deadline - time.monotonic()))
        running = [t for t in self._threads if t.is_alive()]
        release = self.backend.close()
        return running + ([release] if release is not None else [])


__all__ = ["Pending", "WorldDevice", "abort_within"]
