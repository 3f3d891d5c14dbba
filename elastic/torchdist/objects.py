"""torch's ``*_object`` collectives on the elastic group, in elastic.ring.serialization's format.

torch's ``all_gather_object``, ``gather_object``, ``broadcast_object_list`` and
``scatter_object_list`` pickle what they send, unpickle what arrives and allocate whatever size a
peer announces, so a peer chooses which constructors run in every receiver (a 127-byte pickle
calling ``bytearray(10**9)`` takes a gigabyte of each) and how much each allocates. On the
elastic group they run here instead:

- objects travel in ``elastic.ring.serialization``'s format (plain values, containers, tensors and
  arrays; it names nothing and calls nothing): nothing a peer sends runs a constructor;
- one rank's object is at most ``MAX_OBJECT_BYTES`` (1 GiB) encoded, and every size a peer
  announces is checked before anything is allocated;
- what cannot be received (a size out of bounds, bytes that do not decode, a list of the wrong
  length) raises ``BadPeerError`` naming the rank that sent it, on every rank that received it;
- a rank whose own object cannot be carried raises its ``TypeError`` (too large: ``ValueError``)
  and every other rank one naming it, instead of waiting for an object that is not coming.

Every rank that receives an object decodes the same bytes, so all of them reach the same
verdict. On any other group torch's own functions run, unchanged.

``elastic.torchdist.c10d_tables`` puts these functions in ``torch.distributed`` and
``distributed_c10d``, where callers look them up, when the elastic group is first made. Code
that took torch's own before (``from torch.distributed import
all_gather_object`` before ``elastic.process_group()`` first ran) still runs torch's, which
encodes and decodes through ``_object_to_tensor``/``_tensor_to_object``: those are replaced too,
so on the elastic group that path also carries this format and unpickles nothing (the sizes it
allocates stay torch's business).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch.distributed import distributed_c10d as c10d

from elastic.ring import serialization
from elastic.ring.communicator import MAX_OBJECT_BYTES, Communicator, encode_object

class RingGroup:
    """What a group whose collectives run on the elastic ring adds to ``torch.distributed.ProcessGroup``
    (the elastic group and each world's view of it): ``_ring(op)`` gives the ring a call runs on,
    and raises for a view of a world that is over."""

    def _ring(self, what: str) -> Communicator:
        raise NotImplementedError


def _elastic(group: Any) -> bool:
    """Whether ``group`` (None: the default group) is the elastic group: the process's, or one
    world's view of it (``elastic.device_mesh()``'s group, which raises once its world is over)."""
    return isinstance(c10d._world.default_pg if group is None else group, RingGroup)


def _comm(group: Any, op: str) -> Communicator:
    """The ring a call on the elastic group ``group`` runs on (its own check: a view of an
    earlier world raises instead of running on this one)."""
    return (c10d._world.default_pg if group is None else group)._ring(op)


# torch.distributed.checkpoint gathers its plans through the object collectives; they are class
# instances the format cannot carry, and durable commits are elastic-ring's own.
DCP_INSIDE_RUN = ("torch.distributed.checkpoint (dcp.save/dcp.load) cannot run on the elastic group: its plans "
                  "travel as pickles, which the elastic group's object collectives never carry. Make commits durable "
                  "with @elastic.run(checkpoint_dir=DIR, checkpoint_every=N) (a TorchState, or a ShardedState in DCP's "
                  "own format), or save after elastic.run returned on a process group of your own")


def _from_dcp(obj: Any) -> bool:
    """Whether ``obj`` (or an entry of a list of them) is one of torch.distributed.checkpoint's types."""
    values = obj if type(obj) is list else [obj]
    return any(type(v).__module__.startswith("torch.distributed.checkpoint") for v in values)


def _encoded(obj: Any) -> Any:
    """``encode_object(obj)``, with the one-line answer for a DCP plan."""
    encoded, failure, size = encode_object(obj)
    if failure is not None and _from_dcp(obj):
        failure = TypeError(DCP_INSIDE_RUN)
    return encoded, failure, size


def _gather(comm: Communicator, obj: Any, op: str) -> List[Any]:
    """Every rank's encoded object, in rank order: one size exchange (every size checked
    before anything is allocated), then the bytes."""
    encoded, failure, size = _encoded(obj)

    def check(r: int, n: int) -> None:   # the same order on every rank: the same error on every rank
        if r == comm.rank and failure is not None:
            raise failure
        comm.raise_for_object_size(n, r, op)

    return comm.allgather_encoded(encoded, size, check)


def all_gather_object(torch_own: Callable, object_list: List[Any], obj: Any, group: Any = None) -> None:
    """``torch.distributed.all_gather_object``; on the elastic group, see the module doc."""
    if not _elastic(group):
        return torch_own(object_list, obj, group=group)
    op = "all_gather_object"
    comm = _comm(group, op)
    got = [comm.decode_object(data, r, op) for r, data in enumerate(_gather(comm, obj, op))]
    for r, value in enumerate(got):
        object_list[r] = value


def gather_object(torch_own: Callable, obj: Any, object_gather_list: Optional[List[Any]] = None,
                  dst: Optional[int] = None, group: Any = None, group_dst: Optional[int] = None) -> None:
    """``torch.distributed.gather_object``; on the elastic group, see the module doc (every rank
    moves every object, as the ring has no gather; only ``dst`` decodes them)."""
    if not _elastic(group):
        return torch_own(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst)
    op = "gather_object"
    comm = _comm(group, op)
    root = _root(comm, dst, group_dst, op)
    encoded = _gather(comm, obj, op)
    if comm.rank != root:
        return
    if object_gather_list is None or len(object_gather_list) < comm.size:
        raise ValueError(f"{op}: rank {root} gathers, so it needs an object_gather_list of {comm.size} entries")
    got = [comm.decode_object(data, r, op) for r, data in enumerate(encoded)]
    for r, value in enumerate(got):
        object_gather_list[r] = value


def _broadcast(comm: Communicator, objects: Optional[List[Any]], root: int, op: str) -> Any:
    """``comm.broadcast_object``; the root's refusal of a DCP plan says what to do instead."""
    try:
        return comm.broadcast_object(objects, root, op=op)
    except TypeError:
        if comm.rank == root and _from_dcp(objects):
            raise TypeError(DCP_INSIDE_RUN) from None
        raise


def broadcast_object_list(torch_own: Callable, object_list: List[Any], src: Optional[int] = None,
                          group: Any = None, device: Any = None, group_src: Optional[int] = None) -> None:
    """``torch.distributed.broadcast_object_list``; on the elastic group, see the module doc."""
    if not _elastic(group):
        return torch_own(object_list, src=src, group=group, device=device, group_src=group_src)
    op = "broadcast_object_list"
    comm = _comm(group, op)
    root = _root(comm, src, group_src, op)
    got = _broadcast(comm, list(object_list) if comm.rank == root else None, root, op)
    if comm.rank == root:
        return
    if type(got) is not list or len(got) != len(object_list):
        raise comm._blame(f"rank {root} sent {type(got).__name__} where a list of {len(object_list)} objects "
                          "was expected", op, root)
    object_list[:] = got


def scatter_object_list(torch_own: Callable, scatter_object_output_list: List[Any],
                        scatter_object_input_list: Optional[List[Any]] = None, src: Optional[int] = None,
                        group: Any = None, group_src: Optional[int] = None) -> None:
    """``torch.distributed.scatter_object_list``; on the elastic group, see the module doc (the
    root's list goes to every rank, as the ring has no scatter; each keeps its entry)."""
    if not _elastic(group):
        return torch_own(scatter_object_output_list, scatter_object_input_list, src=src, group=group,
                         group_src=group_src)
    op = "scatter_object_list"
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(f"{op}: expected scatter_object_output_list to be a list of at least 1 entry")
    comm = _comm(group, op)
    root = _root(comm, src, group_src, op)
    if comm.rank == root and (scatter_object_input_list is None or len(scatter_object_input_list) != comm.size):
        raise ValueError(f"{op}: rank {root} scatters, so it needs a scatter_object_input_list of {comm.size} "
                         "entries")
    got = _broadcast(comm, list(scatter_object_input_list) if comm.rank == root else None, root, op)
    if comm.rank != root and (type(got) is not list or len(got) != comm.size):
        raise comm._blame(f"rank {root} sent {type(got).__name__} where a list of {comm.size} objects was "
                          "expected", op, root)
    scatter_object_output_list[0] = got[comm.rank]


def _root(comm: Communicator, rank: Optional[int], group_rank: Optional[int], op: str) -> int:
    """The root of a rooted call (the elastic group's ranks are the global ranks)."""
    root = group_rank if group_rank is not None else (rank if rank is not None else 0)
    if not 0 <= root < comm.size:
        raise ValueError(f"{op}: rank {root} is outside the world of {comm.size}")
    return int(root)


# Where code that took torch's functions early encodes and decodes.
def _object_to_tensor(torch_own: Callable, obj: Any, device: Any, group: Any):
    if not _elastic(group):
        return torch_own(obj, device, group)
    encoded, failure, size = _encoded(obj)
    if failure is not None:
        raise failure
    buf = bytearray(size)
    encoded.copy_into(buf)
    # A tensor of its own storage: torch's algorithm resizes it (a view of numpy or bytes cannot be).
    data = torch.frombuffer(buf, dtype=torch.uint8).clone() if size else torch.empty(0, dtype=torch.uint8)
    return data, torch.tensor([size], dtype=torch.long)


def _tensor_to_object(torch_own: Callable, tensor: torch.Tensor, tensor_size: Any, group: Any) -> Any:
    if not _elastic(group):
        return torch_own(tensor, tensor_size, group)
    n = int(tensor_size)
    if not 0 <= n <= min(MAX_OBJECT_BYTES, tensor.numel()):
        raise ValueError(f"an object received on the elastic group announced {n} bytes (at most "
                         f"{min(MAX_OBJECT_BYTES, tensor.numel())})")
    return serialization.loads(tensor.detach().cpu().reshape(-1)[:n].numpy())


# What ``c10d_tables.replace_functions`` puts in place of torch's own, each given torch's own
# as its first argument: the public functions (in ``torch.distributed`` and ``distributed_c10d``)
# and the helpers code that took the public ones early still encodes and decodes through.
PUBLIC = {"all_gather_object": all_gather_object, "gather_object": gather_object,
          "broadcast_object_list": broadcast_object_list, "scatter_object_list": scatter_object_list}
HELPERS = {"_object_to_tensor": _object_to_tensor, "_tensor_to_object": _tensor_to_object}


__all__ = ["MAX_OBJECT_BYTES", "RingGroup", "PUBLIC", "HELPERS", "all_gather_object", "gather_object",
           "broadcast_object_list", "scatter_object_list"]
