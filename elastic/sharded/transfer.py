"""How the shards of ``elastic.ShardedState`` travel between ranks, and the checks on what
arrives: the holdings every rank announces, the buddy copy, the rows a reshard moves (point to
point, forward and backward round the ring, in sizes every rank computes from its own model),
and full tensors gathered from every rank's rows.

A commit copies a rank's shards once, into one flat buffer (``flat_copy``): a 64-byte header
(commit step, world version) and each shard at a 64-byte-aligned offset. That buffer is what
the buddy receives, as it is, in one ``Communicator.shift``: both sides compute every rank's
layout from the same table of tensors (``flat_layout``), so no description travels, nothing
is parsed but the header, and a size other than the layout's is refused before it is read.
Right after a reshard the buddy already holds most rows of its new copy in its copies of the
generation resumed from: only the rest travel (``pack_for_buddy``, ``assemble_buddy``).

Every size used here is this rank's own: the shapes come from the model its ``build()`` made,
and what a peer sends is checked against them before it is kept.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from rendezvous.wire.membership import Blame

from elastic.ring.errors import BadPeerError, CollectiveMismatchError, ErrorKind
from elastic.sharded import reshard


def dtensor_types():
    from torch.distributed.tensor import DTensor, Shard
    return DTensor, Shard


def is_dtensor(t: Any) -> bool:
    DTensor, _ = dtensor_types()
    return isinstance(t, DTensor)


def local_rows(t: Any, what: str) -> torch.Tensor:
    """The rows of a DTensor sharded on dim 0 that this rank holds (FSDP2's unpadded shard)."""
    DTensor, Shard = dtensor_types()
    placements = tuple(t.placements)
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ValueError(f"ShardedState: {what} is placed {placements}; only FSDP2's Shard(0) on a 1-D mesh is "
                         "supported (fully_shard(module, mesh=mesh) with the mesh shard() is given)")
    return t.to_local()


def world_mesh():
    """A 1-D ``DeviceMesh`` over the current world (``elastic.device_mesh()``)."""
    from elastic.torchdist.mesh import device_mesh
    return device_mesh()


def nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(nbytes(v) for v in tree)
    return 0


def clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(clone(v) for v in tree)
    return tree


def gather(comm, t: Any, what: str) -> torch.Tensor:
    """The full tensor of a DTensor sharded on dim 0, gathered from every rank's rows."""
    local = local_rows(t, what).detach().contiguous()
    per_row = math.prod(t.shape[1:])
    full = torch.empty(tuple(t.shape), dtype=t.dtype)
    comm.allgather_into_(full.view(-1), local.view(-1),
                         counts=[(b - a) * per_row for a, b in reshard.chunk_rows(t.shape[0], comm.size)])
    return full


# ---------------------------------------------------------------------- a new world
_NONE = -1


def holding_row(held: Optional[Tuple[reshard.Generation, int]]) -> List[int]:
    if held is None:
        return [_NONE] * 4
    g, r = held
    return [g.step, g.world_version, g.size, r]


def parse_holding(row: List[int]) -> Optional[Tuple[reshard.Generation, int]]:
    step, version, size, rank = row
    # A peer's words: anything out of range is taken as holding nothing (it is then no holder).
    if size < 1 or size > (1 << 20) or not 0 <= rank < size or version < 0 or step < -1:
        return None
    return reshard.Generation(step, version, size), rank


def agree_holdings(comm, held, pending) -> List[reshard.Holding]:
    mine = np.array(holding_row(held) + holding_row(pending[:2] if pending else None), dtype=np.int64)
    rows = comm.allgather_equal(mine).tolist()
    return [reshard.Holding(parse_holding(r[:4]), parse_holding(r[4:])) for r in rows]


def dtype_named(name: str) -> torch.dtype:
    d = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


def expected_shards(table: List[list], rank: int, size: int) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each shard old rank ``rank`` of ``size`` holds."""
    out = {}
    for key, shape, dtype in table:
        a, b = reshard.chunk_rows(shape[0], size)[rank]
        out[key] = ((b - a, *shape[1:]), dtype_named(dtype))
    return out


_ALIGN = 64       # every shard in a flat copy starts at a multiple of this (any dtype's view is aligned)
_HEADER = 16      # a flat copy opens with (commit step, world version), two little-endian int64


def flat_layout(table: List[list], rank: int, size: int) -> Tuple[int, Dict[str, Tuple[int, Tuple[int, ...], torch.dtype]]]:
    """Where each shard of old rank ``rank`` of ``size`` lies in its flat copy: (total bytes,
    key -> (byte offset, shape, dtype)). Every rank computes it from the same table, so a
    buddy copy travels as bytes whose layout neither side takes from the other."""
    at, out = _ALIGN, {}
    for key, (shape, dtype) in expected_shards(table, rank, size).items():
        out[key] = (at, shape, dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        at += -(-nbytes // _ALIGN) * _ALIGN
    return at, out


def flat_views(flat: torch.Tensor, layout) -> Dict[str, torch.Tensor]:
    """The shards of a flat copy, as views of it."""
    out = {}
    for key, (at, shape, dtype) in layout.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[key] = flat[at:at + nbytes].view(dtype).view(shape)
    return out


def flat_buffer(table: List[list], rank: int, size: int, step: int,
                version: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """An empty flat copy of rank ``rank``'s shards (header written, padding zeroed, so no
    stale memory leaves this process) and the views of its shards, to be filled."""
    total, layout = flat_layout(table, rank, size)
    flat = torch.empty(total, dtype=torch.uint8)
    flat[:_ALIGN].zero_()
    flat[:_HEADER].view(torch.int64).copy_(torch.tensor([step, version], dtype=torch.int64))
    views = flat_views(flat, layout)
    for key, v in views.items():
        at = layout[key][0] + v.numel() * v.element_size()
        flat[at:-(-at // _ALIGN) * _ALIGN].zero_()
    return flat, views


def flat_copy(shards: Dict[str, torch.Tensor], table: List[list], rank: int, size: int,
              step: int, version: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """This rank's shards copied once into one flat buffer (what the buddy receives as it is),
    and the views of its shards in it."""
    flat, views = flat_buffer(table, rank, size, step, version)
    for key, v in views.items():
        v.copy_(shards[key])
    return flat, views


def check_buddy(flat: Any, table: List[list], prev: int, size: int, step: int, version: int) -> Dict[str, torch.Tensor]:
    """The previous rank's shards from the bytes it sent, which must be exactly its flat copy
    of commit ``step`` of world ``version``; ValueError otherwise."""
    total, layout = flat_layout(table, prev, size)
    if flat.numel() != total:
        raise ValueError(f"{flat.numel()} bytes, its flat copy has {total}")
    got = flat[:_HEADER].view(torch.int64).tolist()
    if got != [step, version]:
        raise ValueError(f"it is commit {got[0]} of world version {got[1]}, not {step} of {version}")
    return flat_views(flat, layout)


def _row_bytes(entry: list) -> int:
    """Bytes of one row (dimension 0) of a table entry's tensor."""
    _, shape, dtype = entry
    return math.prod(shape[1:]) * dtype_named(dtype).itemsize


def buddy_sent_bytes(pieces: List[reshard.BuddyRows], owner: int, table: List[list]) -> int:
    """The bytes ``owner`` sends its buddy under ``pieces`` (``reshard.buddy_plan``): a header
    naming the commit, then the rows its buddy does not hold."""
    return _HEADER + sum((p.stop - p.start) * _row_bytes(table[p.key]) for p in pieces
                         if p.owner == owner and p.old is None)


def pack_for_buddy(pieces: List[reshard.BuddyRows], me: int, views: Dict[str, torch.Tensor], table: List[list],
                   size: int, step: int, version: int) -> torch.Tensor:
    """What this rank sends its buddy after a reshard: the header, then the rows of its new
    shards (``views``) the buddy does not hold, in the plan's order."""
    out = torch.empty(buddy_sent_bytes(pieces, me, table), dtype=torch.uint8)
    out[:_HEADER].view(torch.int64).copy_(torch.tensor([step, version], dtype=torch.int64))
    at = _HEADER
    for p in pieces:
        if p.owner != me or p.old is not None:
            continue
        key, shape, _ = table[p.key]
        a = reshard.chunk_rows(shape[0], size)[me][0]
        rows = views[key][p.start - a:p.stop - a].contiguous().view(-1).view(torch.uint8)
        out[at:at + rows.numel()] = rows
        at += rows.numel()
    return out


def assemble_buddy(got: Any, pieces: List[reshard.BuddyRows], prev: int, table: List[list], size: int, step: int,
                   version: int, old_size: int, own, buddy) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The previous rank's new flat copy, put together from this rank's copies of the resumed
    generation (``own``, ``buddy``) and the rows it sent (``got``: exactly the plan's bytes,
    naming commit ``step`` of world ``version``); ValueError otherwise."""
    expected = buddy_sent_bytes(pieces, prev, table)
    if got.numel() != expected:
        raise ValueError(f"{got.numel()} bytes, the rows it lacks take {expected}")
    named = got[:_HEADER].view(torch.int64).tolist()
    if named != [step, version]:
        raise ValueError(f"it is commit {named[0]} of world version {named[1]}, not {step} of {version}")
    flat, views = flat_buffer(table, prev, size, step, version)
    at = _HEADER
    for p in pieces:
        if p.owner != prev:
            continue
        key, shape, _ = table[p.key]
        a = reshard.chunk_rows(shape[0], size)[prev][0]
        dst = views[key][p.start - a:p.stop - a]
        if p.old is None:
            n = dst.numel() * dst.element_size()
            if n:
                dst.view(-1).view(torch.uint8).copy_(got[at:at + n])
            at += n
            continue
        copy = own if p.copy == reshard.OWN else buddy
        if copy is None:
            raise RuntimeError(f"ShardedState sync: the buddy plan reads this rank's copy of old rank {p.old}, "
                               "which it does not hold")
        base = reshard.chunk_rows(shape[0], old_size)[p.old][0]
        dst.copy_(copy["shards"][key][p.start - base:p.stop - base])
    return flat, views


def check_table(replicated: Any, model: torch.nn.Module, me: int, root: int) -> List[list]:
    """The root's table of sharded tensors, checked against this rank's own model: only keys
    of its parameters, with their shapes and dtypes (so every size below is this rank's own)."""
    try:
        if type(replicated) is not dict or not {"attrs", "handlers", "buffers", "groups", "scalars",
                                                "table"} <= set(replicated):
            raise ValueError("not a ShardedState commit")
        params = dict(model.named_parameters())
        table = replicated["table"]
        if type(table) is not list:
            raise ValueError("its table is not a list")
        seen = set()
        for entry in table:
            key, shape, dtype = entry
            if key.startswith("model."):
                fqn = key[6:]
            elif key.startswith("optim."):
                fqn = key[6:].rsplit(".", 1)[0]
            else:
                raise ValueError(f"unknown key {key!r}")
            p = params.get(fqn)
            if p is None or list(p.shape) != list(shape) or (key.startswith("model.") and str(p.dtype) != dtype):
                raise ValueError(f"{key!r} of shape {shape} does not fit this model")
            dtype_named(dtype)
            if key in seen:
                raise ValueError(f"{key!r} twice")
            seen.add(key)
        missing = [f for f in params if "model." + f not in seen]
        if missing:
            raise ValueError(f"no parameter {missing[0]!r}")
        return table
    except (ValueError, TypeError) as e:
        if me == root:
            raise ValueError(f"ShardedState: the commit does not fit the model build() made: {e}") from None
        raise BadPeerError(f"ShardedState sync: the state rank {root} sent does not fit the model build() made: {e}",
                           op="sync", peer=root, kind=ErrorKind.BadPeer) from None


def move(comm, decision: reshard.Resume, table: List[list], own, buddy, new: Dict[str, torch.Tensor]) -> int:
    """Fills ``new`` (this rank's new shards, by key: views of its new flat copy) from the
    holders' copies. The rows that change owner travel point to point, the shorter way round
    the ring (``reshard.relay``: forward and backward shifts, store and forward), so a rank
    receives only rows it takes or passes on. Every size is computed alike on every rank, and
    a shift whose bytes differ from them fails on the receiver. Returns the bytes this rank
    received."""
    g = decision.generation
    me, size = comm.rank, comm.size
    rows = [shape[0] for _, shape, _ in table]
    transfers = reshard.plan(rows, g.size, decision.holders, size)
    per_row = [_row_bytes(entry) for entry in table]
    old_chunks = [reshard.chunk_rows(n, g.size) for n in rows]
    nbytes = [(t.stop - t.start) * per_row[t.key] for t in transfers]

    def source(t: reshard.Transfer) -> torch.Tensor:
        copy = own if t.copy == reshard.OWN else buddy
        if copy is None:
            raise RuntimeError(f"ShardedState sync: this rank was chosen to send rows of old rank {t.old} but holds "
                               "no such copy")
        key = table[t.key][0]
        base = old_chunks[t.key][t.old][0]
        return copy["shards"][key][t.start - base:t.stop - base]

    # The bytes of each transfer while this rank holds them (its own to send, or passing through).
    held: Dict[int, torch.Tensor] = {i: source(t).contiguous().view(-1).view(torch.uint8)
                                     for i, t in enumerate(transfers) if t.src == me != t.dst}
    received = 0
    for hop in reshard.relay([(t.src, t.dst) for t in transfers], size):
        step = 1 if hop.forward else -1
        out = [i for i, sender in hop.moves if sender == me]
        into = [i for i, sender in hop.moves if (sender + step) % size == me]
        send = torch.cat([held.pop(i) for i in out]) if out else torch.empty(0, dtype=torch.uint8)
        got = torch.empty(sum(nbytes[i] for i in into), dtype=torch.uint8)
        sender = (me - step) % size
        try:
            comm.shift_into_(send, got, backward=not hop.forward)
        except CollectiveMismatchError as e:
            if e.peer not in (sender, -1):
                raise
            # Every rank computed the bytes of this shift alike: other bytes are the sender's doing.
            raise BadPeerError(f"ShardedState reshard in world version {comm.world_version}: rank {sender} sent "
                               f"other than the {got.numel()} bytes every rank planned for this shift ({e})",
                               op="sync", world_version=comm.world_version, rank=me, peer=sender,
                               kind=ErrorKind.BadPeer, blame=Blame.UNRECEIVABLE) from None
        received += got.numel()
        at = 0
        for i in into:
            held[i] = got[at:at + nbytes[i]]
            at += nbytes[i]
    for i, t in enumerate(transfers):
        if t.dst != me:
            continue
        key = table[t.key][0]
        a = reshard.chunk_rows(table[t.key][1][0], size)[me][0]
        dst = new[key][t.start - a:t.stop - a]
        if t.src == me:
            dst.copy_(source(t))
        elif dst.numel():
            dst.view(-1).view(torch.uint8).copy_(held.pop(i))
    return received
