"""The collective functions of the public API, run on the current world's communicator."""

from __future__ import annotations

import threading
from typing import Any, Optional

from .communicator import Communicator, Handle
from .errors import RendezvousError
from .ops import ReduceOp

_lock = threading.Lock()
_current: Optional[Communicator] = None


def set_communicator(comm: Optional[Communicator]) -> None:
    """Makes ``comm`` the one the module-level collectives use (the runtime calls this
    after every re-form; tests call it with a communicator formed by hand)."""
    global _current
    with _lock:
        _current = comm


def current_communicator() -> Communicator:
    comm = _current
    if comm is None:
        raise RendezvousError("no communicator: call elastic.init() (or run under elastic.run) first")
    return comm


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
