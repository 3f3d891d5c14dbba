"""The current world as this process sees it: ``rank()``, ``size()`` … and the ring the collectives run on.

The running session (``elastic.runtime.session``) holds the current world and its ring; it is entered
here when ``elastic.init()`` starts it and left when it ends, and the last world it was in stays
readable then: after ``elastic.run`` returned, ``rank()``, ``size()`` … answer with the last
world's values. A worker whose function returned keeps that world's ring for the collectives a
script runs after training (a barrier, a last all_reduce), no longer elastic, until
``dist.destroy_process_group()``, ``elastic.shutdown()``, the next ``elastic.init()`` or the
exit; otherwise ``ring()`` raises an error saying the job has finished. A ring formed by hand
from an explicit peer list (tools, tests: ``Communicator.form``) can be installed with
``use_ring()``; the session's ring comes first while one runs.

Everything that asks "which world am I in" asks here, so every layer gets the same answer.
"""

from __future__ import annotations

import atexit
import threading
from typing import Optional, Protocol, Tuple

from rendezvous.client.watch_events import WorldInfo

from elastic.ring.communicator import Communicator
from elastic.ring.errors import RendezvousError


class Holder(Protocol):
    """What holds the current world: the running session (``elastic.runtime.session.Session``)."""

    comm: Optional[Communicator]   # the ring of ``world``, formed or forming; None once left
    world: Optional[WorldInfo]     # None until the first world is taken


_lock = threading.Lock()
_holder: Optional[Holder] = None
_ring: Optional[Communicator] = None        # a ring installed by hand (tools, tests), when no session runs
_last: Optional[Tuple[str, Optional[WorldInfo]]] = None   # (job id, last world) once the session ended
_after: Optional[Communicator] = None       # the last world's ring, kept after elastic.run returned


def attach(holder: Holder) -> None:
    """``holder`` (a session that just started) answers from now on."""
    global _holder, _last
    with _lock:
        _holder, _last = holder, None


def detach(holder: Holder, job_id: str) -> None:
    """``holder`` ended: its last world answers ``rank()`` … from now on, and collectives raise
    (unless ``keep_after_run`` is given that world's ring)."""
    global _holder, _last
    with _lock:
        if _holder is holder:
            _holder, _last = None, (job_id, holder.world)


def keep_after_run(comm: Communicator) -> None:
    """Collectives after ``elastic.run`` returned run on ``comm``, the last world's ring."""
    global _after
    with _lock:
        old, _after = _after, comm
    if old is not None:
        old.close()


def close_after_run() -> None:
    """Closes the ring kept for collectives after ``elastic.run`` returned, if any."""
    global _after
    with _lock:
        comm, _after = _after, None
    if comm is not None:
        comm.close()


atexit.register(close_after_run)


def holder() -> Optional[Holder]:
    return _holder


def use_ring(comm: Optional[Communicator]) -> None:
    """Makes ``comm`` the ring the collectives run on while no session runs: for tools and
    tests that form a ring by hand from an explicit peer list (``Communicator.form``)."""
    global _ring
    with _lock:
        _ring = comm


def current_ring() -> Optional[Communicator]:
    """The ring the collectives run on now, or None (``ring()`` says why)."""
    h = _holder
    if h is not None:
        return h.comm
    return _ring if _ring is not None else _after


def ring() -> Communicator:
    """The ring the collectives run on now; a clear error when there is none."""
    comm = current_ring()
    if comm is not None:
        return comm
    last = _last
    if last is not None:
        raise RendezvousError(f"job {last[0]} has finished and this worker's ring is closed (elastic.run returned "
                              "without this worker's function completing, or dist.destroy_process_group() or "
                              "elastic.shutdown() ran): rank(), size() and world_version() still answer with its "
                              "last world")
    raise RendezvousError("no ring: call elastic.init() (or run your function under @elastic.run) first")


def current_world() -> Optional[WorldInfo]:
    """The world this worker is in, or the last one it was in after the session ended; None
    before any (a worker that has not joined, or only uses a ring formed by hand)."""
    h = _holder
    if h is not None:
        return h.world
    last = _last
    return last[1] if last is not None else None


def position() -> Optional[Tuple[int, int]]:
    """(rank, size) of this process now, the one answer every layer uses: the running session's
    world, else that of a ring installed by hand (the collectives run on it), else the last
    world's after the session ended; None before any."""
    h = _holder
    if h is not None and h.world is not None:
        return h.world.rank, h.world.size
    comm = _ring
    if h is None and comm is not None:
        return comm.rank, comm.size
    world = current_world()
    return (world.rank, world.size) if world is not None else None


def rank_now(default: int = 0) -> int:
    """This process's rank (``position()``), or ``default`` before any world or ring."""
    where = position()
    return where[0] if where is not None else default


# ---------------------------------------------------------------------- the public accessors
def _world(what: str) -> WorldInfo:
    world = current_world()
    if world is None:
        raise RendezvousError(f"elastic.{what}(): no world yet: call elastic.init() (or run your function under "
                              "@elastic.run) first")
    return world


def _position(what: str) -> Tuple[int, int]:
    where = position()
    if where is None:
        _world(what)   # raises, saying how to get a world
    return where


def rank() -> int:
    """This worker's rank in the current world (after ``elastic.run`` returned: in its last world;
    on a ring installed by hand: in that ring)."""
    return _position("rank")[0]


def size() -> int:
    """Number of workers in the current world (after ``elastic.run`` returned: in its last world;
    on a ring installed by hand: in that ring)."""
    return _position("size")[1]


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
