"""Graceful leave: a worker's request to leave its job (SIGTERM, SIGINT, ``elastic.request_leave()``)
and the grace period it has to do so.

Preemptible VMs, Kubernetes eviction and Slurm all announce the end with SIGTERM and a grace
period. The request is only recorded here; the session carries it out at the next commit
boundary, where every rank learns of it through the same membership allreduce as a join
(``Session.check_membership``, see ``elastic.runtime.session``), so the survivors keep their state. If no boundary comes
within the grace (``ELASTIC_PREEMPT_GRACE``), the worker ends as a failure: a log line, then
``os._exit(GRACE_EXPIRED_EXIT)``, and the survivors restore their last commit as for any lost peer.

The signal handler runs in the main thread between two bytecodes of whatever it interrupted, so
it only records the request under a reentrant lock; the grace is kept by a daemon thread.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import logging
import os
import signal
import threading
import time
from typing import Callable, Dict, Optional

log = logging.getLogger("elastic")

# The status of a worker whose grace ran out: 128 + SIGTERM, what a shell reports for a process
# SIGTERM killed, so a launcher treats it as it treated such a worker before graceful leave (a
# failure the job recovers from, respawned unless it was being stopped), not as a program error.
GRACE_EXPIRED_EXIT = 128 + int(signal.SIGTERM)

LEAVE_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# Slurm signals every process of a job step (scancel --signal, --signal=TERM@T, preemption), the
# launcher among them, and the launcher passes its SIGTERM on to each worker: one request arrives
# twice, moments apart. A SIGTERM repeated within this window is that request again.
REPEAT_WINDOW_S = 2.0


def insists(signum: int, first_at: float, now: float) -> bool:
    """Whether a second ``signum`` (the first arrived at ``first_at``) ends the worker the old way:
    a second SIGINT always (Ctrl-C twice), a second SIGTERM only after ``REPEAT_WINDOW_S``."""
    return signum != signal.SIGTERM or now - first_at >= REPEAT_WINDOW_S


def _expire(message: str) -> None:
    log.error("%s", message)
    for handler in logging.getLogger().handlers + log.handlers:
        try:
            handler.flush()
        except Exception:  # exiting anyway
            pass
    os._exit(GRACE_EXPIRED_EXIT)


class LeaveCause(enum.Enum):
    """What asked this worker to leave: the exception ``elastic.run`` ends with says the same."""

    SIGNAL = "signal"          # SIGTERM or SIGINT: a preemption notice (elastic.Preempted)
    PROGRAM = "program"        # elastic.request_leave() (elastic.LeaveRequested)
    STRAGGLER = "straggler"    # the straggler policy evict chose it (elastic.EvictedAsStraggler)


class LeaveRequest:
    """Whether this worker was asked to leave, and the watch over its grace period.

    ``request(why, cause)`` records the first request (later ones change nothing); ``pending`` is
    True from then until ``finish()`` (the worker left, or its session ended otherwise). ``cause``
    says what asked; a straggler's leave (``elastic.runtime.straggler_detector``, the evict policy)
    is told to the rendezvous as such, and the worker's host cools down. ``on_request``
    runs once, in the watch thread, when a request arrives (the session wakes its waits with it);
    ``expire(message)`` runs there when the grace runs out first."""

    def __init__(self, grace_s: float, worker: str, on_request: Callable[[], None] = lambda: None,
                 expire: Callable[[str], None] = _expire):
        self.grace_s, self.worker = grace_s, worker
        self._on_request, self._expire = on_request, expire
        # Reentrant: a signal handler may interrupt the main thread inside request() itself.
        self._cond = threading.Condition(threading.RLock())
        self.requested_at: Optional[float] = None
        self.why = ""
        self.cause = LeaveCause.SIGNAL
        self._finished = False
        self._thread = threading.Thread(target=self._watch, name="elastic-preempt-grace", daemon=True)
        self._thread.start()

    def request(self, why: str, cause: LeaveCause = LeaveCause.SIGNAL) -> None:
        with self._cond:
            if self.requested_at is None and not self._finished:
                self.requested_at, self.why, self.cause = time.monotonic(), why, cause
                self._cond.notify_all()

    @property
    def straggler(self) -> bool:
        """The request came from straggler detection."""
        return self.cause is LeaveCause.STRAGGLER

    @property
    def pending(self) -> bool:
        with self._cond:
            return self.requested_at is not None and not self._finished

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def _watch(self) -> None:
        with self._cond:
            while self.requested_at is None and not self._finished:
                self._cond.wait(1.0)
            if self._finished:
                return
            why, deadline = self.why, self.requested_at + self.grace_s
        log.warning("worker %s asked to leave (%s): leaving at its next commit (grace %g s)", self.worker, why,
                    self.grace_s)
        self._on_request()
        with self._cond:
            while not self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            if self._finished:
                return
        self._expire(f"worker {self.worker} was asked to leave ({why}) and reached no commit boundary within "
                     f"{self.grace_s:g} s (ELASTIC_PREEMPT_GRACE): leaving as a failure "
                     f"(exit status {GRACE_EXPIRED_EXIT})")


@dataclasses.dataclass
class Handlers:
    """What ``install_handlers`` replaced (``previous``: signal -> handler) and when each of the
    leave signals first arrived (``first_at``: signal -> monotonic time)."""
    previous: Dict[int, object]
    first_at: Dict[int, float]


def install_handlers(request: Callable[[str], None]) -> Optional[Handlers]:
    """Makes SIGTERM and SIGINT call ``request(signal name)`` (a second one of the same signal does
    what the replaced handler did: KeyboardInterrupt, or the default action; see ``insists`` for a
    SIGTERM delivered twice); returns what they replaced, for ``restore_handlers``, or None
    when this is not the main thread (Python allows signal handlers only there;
    ``elastic.request_leave()`` still works)."""
    if threading.current_thread() is not threading.main_thread():
        log.debug("not the main thread: no SIGTERM/SIGINT handlers; use elastic.request_leave()")
        return None
    installed = Handlers({}, {})
    first_at = installed.first_at
    # The repeat of a SIGTERM an earlier run left on, still due: absorbed, not a new request.
    absorb_until: Dict[int, float] = {}

    def on_signal(signum, frame) -> None:
        now = time.monotonic()
        if signum not in first_at:
            if now < absorb_until.get(signum, 0.0):
                return
            first_at[signum] = now
            request(signal.Signals(signum).name)
            return
        if not insists(signum, first_at[signum], now):
            return
        # The same signal again: the sender insists. Do what it did before graceful leave
        # (KeyboardInterrupt for a second Ctrl-C, the default action for SIGTERM).
        restore_handlers(installed)
        os.kill(os.getpid(), signum)

    for sig in LEAVE_SIGNALS:
        replaced = signal.signal(sig, on_signal)
        if isinstance(replaced, _AbsorbRepeat):   # an earlier run's: what it stands in for, and its window
            absorb_until[sig] = replaced.asked_at + REPEAT_WINDOW_S
            replaced = replaced.previous
        installed.previous[sig] = replaced
    return installed


def restore_handlers(installed: Optional[Handlers]) -> None:
    """Puts back the handlers ``install_handlers`` replaced. A worker that left on a SIGTERM
    that arrived less than ``REPEAT_WINDOW_S`` ago may still get its repeat (a leave at the
    first commit takes milliseconds; Slurm's copy or elastic-run's may come after it): until the
    window ends, that repeat is absorbed as it was while the run lasted (``_AbsorbRepeat``), so
    it does not kill a worker that has left and is on its way out."""
    if not installed or threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in installed.previous.items():
        # None: set from C, not Python; the default is the closest Python can put back.
        handler = handler if handler is not None else signal.SIG_DFL
        asked = installed.first_at.get(sig)
        if asked is not None and not insists(sig, asked, time.monotonic()):
            handler = _AbsorbRepeat(asked, handler)
        signal.signal(sig, handler)


class _AbsorbRepeat:
    """The handler of a signal that made this worker leave at ``asked_at``, put in place of
    ``previous`` once the run ended: a repeat within the window is absorbed; after it, the
    first one puts ``previous`` back and is delivered to it, as if it had been there all along."""

    def __init__(self, asked_at: float, previous: object):
        self.asked_at = asked_at
        self.previous = previous

    def __call__(self, signum, frame) -> None:
        due = not insists(signum, self.asked_at, time.monotonic())
        if signal.getsignal(signum) is not self:
            # Called by a handler installed after this one that passes signals on to the one it
            # replaced: stand in for ``previous`` without touching the installed handler.
            if not due and callable(self.previous):
                self.previous(signum, frame)
            return
        if due:
            return
        signal.signal(signum, self.previous)
        os.kill(os.getpid(), signum)


def _ignore_a_due_repeat_at_exit() -> None:
    # Python puts the default action back for its own handlers late in its exit, after the
    # atexit functions (this one is registered at import, so it runs after those registered
    # later: torch's, the program's): a repeat still due then would kill a worker that left
    # and is exiting. It is ignored instead; whatever runs of the exit after this is brief,
    # and the launcher's SIGKILL still bounds it.
    handler = signal.getsignal(signal.SIGTERM)
    if isinstance(handler, _AbsorbRepeat) and not insists(signal.SIGTERM, handler.asked_at, time.monotonic()):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


atexit.register(_ignore_a_due_repeat_at_exit)
