"""The collective functions of the public API, run on the current world's communicator."""

from __future__ import annotations

from typing import Any, Optional

from elastic.runtime import world
from elastic.ring.communicator import Communicator, Handle
from elastic.ring.ops import ReduceOp


def set_communicator(comm: Optional[Communicator]) -> None:
    """Makes ``comm`` the ring the module-level collectives use (tools and tests that form a ring
    by hand; ``elastic.runtime.world.use_ring``). Refused while a job's session runs."""
    world.use_ring(comm)


def current_communicator() -> Communicator:
    """The ring the collectives run on now (see ``elastic.runtime.world.ring``)."""
    return world.ring()


def allreduce(tensor: Any, op: ReduceOp = ReduceOp.Average) -> Any:
    """Returns a new tensor holding the reduction of ``tensor`` over all ranks."""
    return current_communicator().allreduce(tensor, op)


def allreduce_(tensor: Any, op: ReduceOp = ReduceOp.Average) -> Any:
    """Reduces ``tensor`` over all ranks in place and returns it."""
    return current_communicator().allreduce_(tensor, op)


def allreduce_async_(tensor: Any, op: ReduceOp = ReduceOp.Average) -> Handle:
    """Starts an in-place allreduce; small ones submitted back to back are fused."""
    return current_communicator().allreduce_async_(tensor, op)


def synchronize(handle: Handle) -> Any:
    """Waits for an async collective and returns its tensor."""
    return handle._comm.synchronize(handle)


def broadcast_(tensor: Any, root_rank: int = 0) -> Any:
    """Overwrites ``tensor`` on every rank with ``root_rank``'s."""
    return current_communicator().broadcast_(tensor, root_rank)


def allgather(tensor: Any) -> Any:
    """Concatenates every rank's tensor along dimension 0 (lengths may differ)."""
    return current_communicator().allgather(tensor)


def barrier() -> None:
    """Returns once every rank has entered the barrier."""
    current_communicator().barrier()


def broadcast_object(obj: Any = None, root_rank: int = 0) -> Any:
    """Returns ``root_rank``'s object on every rank (what it may hold: ``Communicator.broadcast_object``)."""
    return current_communicator().broadcast_object(obj, root_rank)
