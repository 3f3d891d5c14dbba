"""Who called another collective than the majority: each rank's record of the collective its ring failed in, and the judgement on every rank's record.

When ranks of one world call different collectives (a stale image, a rank with a data-dependent
branch, a bit flip), the rank that receives the odd rank's first segment fails with
``CollectiveMismatchError`` and the others with a failure further round the ring. No rank can
tell from that alone who differs: the receiver sees only its sender, and the sender may be the
honest one. So every rank keeps the collective its ring failed in (``FailedCall``, from the core:
its sequence number on the communicator and ``tag``, what it is; or that it failed outside any
collective), the world is formed again with the same members, and its first collective is one
allgather of every rank's ``Record`` (``encode``/``decode``, a fixed row: nothing a peer sends
sizes anything). ``judge`` decides on
every rank alike:

* The failed world is the one most ranks recorded (ties: the newest), older than the world that
  compares (a record of that world or a later one is forged: no record). No record of it says a
  mismatch: nothing to judge (a failure, not a divergence).
* The participants are the ranks that recorded that world. They are compared at one sequence
  number, the one most of those in a collective failed at (ties: the lowest): a rank that failed
  in another collective (a member died while the others were one collective apart), or in none
  (it was computing when the world was aborted), says nothing about what it called, so it is not
  judged; it still counts among the participants a majority must exceed half of.
* A call (seq, tag) that more than half of the participants recorded is the majority's: every
  participant at that sequence number with another call diverged (``Diverged``). The others blame
  it (``BadPeerError``, blame ``DIVERGED``: the rendezvous evicts it on the majority's reports),
  it ends with ``CollectiveMismatchError`` (outvoted), and the others go on.
* Every participant in a collective at one sequence number, at least two of them, and no call
  more than half of them recorded: no majority explains it (a world of two, a three-way split, every rank calling its
  own size: a bug in the program). Every participant stops with one line naming each rank's call
  (``NoMajority``); the others (newcomers, which took no part in that world) go on without them.
* Anything else (every participant recorded the same call): nothing to judge.

A member that lies in its record can only make itself the odd one or escape judgement: the honest
ranks' calls at one sequence number are the same (a call is what the rank itself asked for: sizes
a peer announced, an allgather's or a broadcast_object's, are not part of it, so a relay cannot
make honest calls differ), and they are the majority in a world of three or more. (One that
escapes by claiming another call diverges again, and the world re-forms again: the receiver alone
sees what it sent.) A newcomer that forges a record can only stop itself and the participants
with no majority, never a world with one. Descriptions are shown, never compared: the decision
is on numbers only.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np

from rendezvous.common.peer_text import shown
from rendezvous.wire.membership import Blame

from elastic.ring.errors import BadPeerError, CollectiveMismatchError, ElasticError, ErrorKind, FailedCall

OP = "check_divergence"             # the op of the exchange and of the errors its verdicts raise
DESCRIBE_BYTES = 96                  # a call's description travels cut to this many UTF-8 bytes
ROW_WORDS = 4 + DESCRIBE_BYTES // 8  # [world version, mismatch, seq, tag, description...]
_U32 = 1 << 32


@dataclasses.dataclass(frozen=True)
class Record:
    """What one rank recorded of the collective its ring of ``world_version`` failed in (``call``
    None: it failed outside any); ``mismatch``: it received a segment of another collective
    (``CollectiveMismatchError``)."""

    world_version: int
    mismatch: bool
    call: Optional[FailedCall]


def encode(record: Optional[Record]) -> np.ndarray:
    """This rank's row of the exchange (all zeros: no record)."""
    row = np.zeros(ROW_WORDS, dtype=np.int64)
    if record is None:
        return row
    call = record.call
    row[:4] = [record.world_version, int(record.mismatch), call.seq if call else -1, call.tag if call else 0]
    text = call.describe.encode("utf-8", "replace")[:DESCRIBE_BYTES] if call else b""
    row[4:].view(np.uint8)[:len(text)] = np.frombuffer(text, dtype=np.uint8)
    return row


def decode(row: np.ndarray) -> Optional[Record]:
    """A rank's record from its row: None for no record, and for a row no worker writes (a
    version below 1, a flag other than 0 or 1, a sequence number or tag outside 32 bits, -1 for
    no call): such a rank takes no part in the judgement, so a forged row decides nothing."""
    version, mismatch, seq, tag = (int(v) for v in row[:4])
    if version < 1 or mismatch not in (0, 1) or not -1 <= seq < _U32 or not 0 <= tag < _U32:
        return None
    if seq < 0:
        return Record(version, bool(mismatch), None)
    text = np.ascontiguousarray(row[4:ROW_WORDS]).view(np.uint8).tobytes().rstrip(b"\0")
    return Record(version, bool(mismatch), FailedCall(seq, tag, text.decode("utf-8", "replace")))


@dataclasses.dataclass(frozen=True)
class Nothing:
    """No divergence to act on: every rank drops its record."""


@dataclasses.dataclass(frozen=True)
class Diverged:
    """``odd`` (ranks, ascending) called another collective than the majority's ``call`` in
    world ``world_version``; ``calls``: what each odd rank called."""

    world_version: int
    odd: Tuple[int, ...]
    call: FailedCall
    calls: Tuple[Tuple[int, FailedCall], ...]


@dataclasses.dataclass(frozen=True)
class NoMajority:
    """The participants of world ``world_version`` called different collectives and no call is
    the majority's: ``calls`` holds (rank, call) of each."""

    world_version: int
    calls: Tuple[Tuple[int, FailedCall], ...]


Verdict = Union[Nothing, Diverged, NoMajority]


def judge(records: Sequence[Optional[Record]], world_version: int) -> Verdict:
    """The verdict on every rank's record (index: rank) in world ``world_version``, as the module doc says."""
    held = [(r, rec) for r, rec in enumerate(records) if rec is not None and rec.world_version < world_version]
    if not held:
        return Nothing()
    versions = collections.Counter(rec.world_version for _, rec in held)
    newest = max(versions, key=lambda v: (versions[v], v))
    part = [(r, rec) for r, rec in held if rec.world_version == newest]
    called = [(r, rec) for r, rec in part if rec.call is not None]
    if not called or not any(rec.mismatch for _, rec in part):
        return Nothing()
    seq, _ = _most_common([rec.call.seq for _, rec in called])
    at_seq = [(r, rec) for r, rec in called if rec.call.seq == seq]
    tag, held_by = _most_common([rec.call.tag for _, rec in at_seq])
    if 2 * held_by > len(part):
        odd = tuple((r, rec.call) for r, rec in at_seq if rec.call.tag != tag)
        if not odd:
            return Nothing()
        call = next(rec.call for _, rec in at_seq if rec.call.tag == tag)
        return Diverged(newest, tuple(r for r, _ in odd), call, odd)
    if len(at_seq) == len(part) >= 2:
        return NoMajority(newest, tuple((r, rec.call) for r, rec in part))
    return Nothing()


def verdict_error(verdict: Union[Diverged, NoMajority], rank: int, world_version: int,
                  name: Callable[[int], str]) -> Optional[ElasticError]:
    """What rank ``rank`` of world ``world_version`` (the world that compared) raises for
    ``verdict``: outvoted, it ends (``CollectiveMismatchError``); one of the others blames the
    first odd rank (``BadPeerError``, blame ``DIVERGED``); without a majority every participant
    ends, and the others raise nothing (None). ``name(r)`` says who rank ``r`` is ("worker W (rank R)")."""
    where = f"collective mismatch in world version {verdict.world_version}"
    if isinstance(verdict, NoMajority) and rank not in dict(verdict.calls):
        return None
    if isinstance(verdict, NoMajority):
        calls = "; ".join(f"{name(r)} called {shown(c.describe)}" for r, c in verdict.calls)
        return CollectiveMismatchError(
            f"{where}: its ranks called different collectives and no call is the majority's (a bug in the "
            f"program: every rank must call the same collectives in the same order, with the same dtype, op and "
            f"size): {calls}", op=OP, world_version=world_version, rank=rank, decided=True)
    odd = dict(verdict.calls)
    majority = f"the majority of the world called {shown(verdict.call.describe)}"
    if rank in odd:
        return CollectiveMismatchError(
            f"{where}: this rank called {shown(odd[rank].describe)} where {majority}; it differs from the majority "
            "of the world and leaves it (the others go on without it)", op=OP, world_version=world_version,
            rank=rank, decided=True, outvoted=True)
    first, *rest = verdict.odd
    also = f" (and {', '.join(name(r) for r in rest)})" if rest else ""
    return BadPeerError(f"{where}: {name(first)} called {shown(odd[first].describe)} where {majority}{also}: it "
                        "diverged from the majority", op=OP, world_version=world_version, rank=rank, peer=first,
                        kind=ErrorKind.BadPeer, blame=Blame.DIVERGED)


def _most_common(values: Sequence[int]) -> Tuple[int, int]:
    """The value held most often, and how often; among equals, the lowest (every rank picks the same)."""
    counts = collections.Counter(values)
    value = min(counts, key=lambda v: (-counts[v], v))
    return value, counts[value]


__all__ = ["DESCRIBE_BYTES", "Diverged", "NoMajority", "Nothing", "OP", "Record", "Verdict", "decode", "encode",
           "judge", "verdict_error"]
