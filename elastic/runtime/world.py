"""The current world as this process sees it: ``rank()``, ``size()`` … and the ring the collectives run on.

Every answer comes from the process's session (``elastic.runtime.current``), so every layer gets
the same one. After ``elastic.run`` returned, ``rank()``, ``size()`` … answer with the last
world's values. A worker whose function returned keeps that world's ring for the collectives a
script runs after training (a barrier, a last all_reduce), no longer elastic, until
``dist.destroy_process_group()``, ``elastic.shutdown()``, the next ``elastic.init()`` or the exit;
otherwise ``ring()`` raises an error saying the job has finished. A ring formed by hand from an
explicit peer list (tools, tests: ``Communicator.form``) is installed with ``use_ring()``, as a
session of its own; it never replaces a running job's.
"""

from __future__ import annotations

from typing import Optional, Tuple

from rendezvous.client.watch_events import WorldInfo

from elastic.ring.communicator import Communicator
from elastic.runtime import current
from elastic.runtime.errors import RendezvousError
from elastic.runtime.session import Session


def ring(what: str = "") -> Communicator:
    """The ring the collectives run on now; a clear error when there is none."""
    s = current.session()
    if s is None:
        raise RendezvousError("no ring: call elastic.init() (or run your function under @elastic.run) first")
    return s.ring(what)


def current_ring() -> Optional[Communicator]:
    """The ring the collectives run on now, or None (``ring()`` says why)."""
    s = current.session()
    return s.comm if s is not None else None


def use_ring(comm: Optional[Communicator]) -> None:
    """Makes ``comm`` the ring the collectives run on (None: none), for tools and tests that
    form a ring by hand from an explicit peer list (``Communicator.form``). Refused while a job's
    session runs: its ring is the one every layer must use."""
    s = current.session()
    if s is not None and type(s) is not Session and not s.ended:
        raise RendezvousError("use_ring: a job's session runs in this process; its ring is the current one")
    replaced = current.install(Session(comm) if comm is not None else None)
    if replaced is not None and type(replaced) is not Session:
        replaced.close_ring()   # the ring an ended job kept for collectives after its run


def close_kept_ring() -> None:
    """Closes the ring an ended job kept for collectives after its run, if any
    (``dist.destroy_process_group()``); a running job's ring, or one installed by hand, stays."""
    s = current.session()
    if s is not None and s.ended:
        s.close_ring()


def current_world() -> Optional[WorldInfo]:
    """The world this worker is in, or the last one it was in after the session ended; None
    before any (a worker that has not joined, or only uses a ring formed by hand)."""
    s = current.session()
    return s.world if s is not None else None


def position() -> Optional[Tuple[int, int]]:
    """(rank, size) of this process now, the one answer every layer uses; None before any world or ring."""
    s = current.session()
    return s.position() if s is not None else None


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
    """This worker's index among the workers on its host in the current world. It changes with
    worlds and is not a device index: a GPU is named by ``LOCAL_RANK`` (set by elastic-run for the
    worker's life) or ``torch.cuda.current_device()``."""
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
    return _world("world_version").world_version
