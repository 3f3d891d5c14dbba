"""The ring kept after the run: each member must enter every collective within a bound, and one that does not is named.

During the run the rendezvous watches every member (a stopped one misses its heartbeat, one
that left is announced) and aborts the ring in flight. After ``elastic.run`` returned, the
session is over: nobody watches, and a member that skips the script's last ``dist.barrier()``
(a stale image, a branch on its rank) would hold the others for the whole collective timeout.
So on a kept ring each collective starts with an arrival step: every rank sends 8 bytes to the
next one and waits at most ``bound_s`` for its previous rank's. Only the rank after a missing
member waits on it; the others are let through by their own previous rank and block in the
collective itself. When the bound passes, the rank that waited aborts the ring (its error names
the member that did not arrive, by worker id), and the abort reaches every other rank within
milliseconds as a failure further round the ring. A failed collective raises, as torch's
barrier does on its timeout; nothing a peer sent is read (the 8 bytes are only awaited).

Asynchronous allreduces keep the collective timeout (DDP is not run after the run).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np

from elastic.ring.errors import ErrorKind, WorkerLostError, from_native

SETTING = "ELASTIC_AFTER_RUN_TIMEOUT"


def failure_message(op: str, kind: ErrorKind, *, missed_arrival: bool, peer: str, bound_s: float,
                    original: str) -> str:
    """What a rank raises when collective ``op`` on the kept ring failed. ``peer``: the neighbour
    involved, named (``worker W (rank R)``, or ``rank R`` outside this rank's view; "" for none);
    ``missed_arrival``: this rank waited ``bound_s`` for that neighbour to enter ``op``."""
    bound = f"{bound_s:g} s ({SETTING})"
    if missed_arrival:
        return (f"{peer} did not arrive at {op} within {bound} on the ring kept after the run: it is alive "
                f"but never called {op} (a script that skips it on some ranks, or a stale image); the ring "
                "is closed and every other member's collective fails too")
    if kind == ErrorKind.Propagated and peer:
        return (f"{op} on the ring kept after the run failed: {peer} gave up on it because of a failure "
                f"further round the ring (a member that did not arrive within {bound_s:g} s, {SETTING}, or one "
                "that exited); "
                f"the rank after that member names it. {original}")
    if kind == ErrorKind.PeerLost and peer:
        return (f"{op} on the ring kept after the run failed: {peer} closed its ring (it exited, or "
                f"called dist.destroy_process_group()) before this rank's {op} completed. {original}")
    return f"{op} on the ring kept after the run failed: {original}"


class Arrival:
    """The arrival rule of one kept ring (see the module doc). ``name(rank)`` says who a rank
    is (``worker W (rank R)``); the communicator's blocking collectives run through ``run``."""

    def __init__(self, bound_s: float, name: Callable[[int], str]):
        if not bound_s > 0:
            raise ValueError(f"{SETTING}={bound_s:g} must be positive (seconds)")
        self.bound_s = bound_s
        self.name = name

    def run(self, comm: Any, native: Any, op: str, body: Callable[[], Any], failure: type) -> Any:
        """``body()`` (collective ``op`` of ``comm``), after every member entered it: the
        previous rank's arrival awaited at most ``bound_s``. ``failure``: the core's exception
        type (``RingFailure``), translated here with what happened said."""
        if comm.size > 1:
            self._await_previous(comm, native, op, failure)
        try:
            return body()
        except failure as f:
            raise self._described(op, from_native(f)) from None

    def _await_previous(self, comm: Any, native: Any, op: str, failure: type) -> None:
        prev = (comm.rank - 1) % comm.size
        fired = threading.Event()

        def give_up() -> None:
            fired.set()
            comm.abort(f"{self.name(prev)} did not arrive at {op} within {self.bound_s:g} s ({SETTING})")

        timer = threading.Timer(self.bound_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            native.shift_(np.zeros(1, dtype=np.int64), np.empty(1, dtype=np.int64), False)
        except failure as f:
            err = from_native(f)
            if fired.is_set():   # this rank's own abort: the previous rank never came
                raise self._missing(comm, op, prev, err) from None
            raise self._described(op, err) from None
        finally:
            timer.cancel()
        if fired.is_set():   # it came as the bound passed: the ring is aborted all the same
            raise self._missing(comm, op, prev, None)

    def _missing(self, comm: Any, op: str, prev: int, err: Optional[Exception]) -> WorkerLostError:
        message = failure_message(op, ErrorKind.Timeout, missed_arrival=True, peer=self.name(prev),
                                  bound_s=self.bound_s, original=str(err or ""))
        return WorkerLostError(message, op=op, world_version=comm.world_version, rank=comm.rank, peer=prev,
                               kind=ErrorKind.Timeout)

    def _described(self, op: str, err: Exception) -> Exception:
        """``err`` with the kept ring's account of it; the same attributes. Other classes (a
        peer to blame, a mismatch) say what they say already."""
        if type(err) is not WorkerLostError:
            return err
        peer = self.name(err.peer) if err.peer >= 0 else ""
        message = failure_message(op, err.kind, missed_arrival=False, peer=peer, bound_s=self.bound_s,
                                  original=str(err))
        return WorkerLostError(message, op=err.op, world_version=err.world_version, rank=err.rank, peer=err.peer,
                               kind=err.kind)
