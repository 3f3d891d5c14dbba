"""How a state travels at a sync: from the rank holding the most advanced commit to every rank.

The session runs it at every sync of its step protocol (``elastic.runtime.session``, which says when).
One allgather agrees on the most advanced state (``most_advanced``: the highest commit step,
then the most steps kept live since it); that rank (the lowest of them), the root, sends its
state, encoded by ``elastic.ring.serialization``; every rank that does not hold it already loads
those bytes, so all hold the same bits afterwards.

A rank holds the root's state already when it stands at the same place (``State.standing()``) and its encoding
has the same length and CRC-32 (``holders``; the allgather carries both): the survivors of a
failure that kept their live state, or the members a newcomer joins. When every rank holds it,
nothing is sent and each adopts its live state as the synced commit (``State.adopt_live``):
after a failure that is the common case, and it keeps a 100 MB state's copy, broadcast, decode
and load (and their fresh memory) off the recovery. Otherwise the root's bytes must have the
length and CRC it announced, or every rank refuses them; a holder adopts its live state only
once the bytes hash (SHA-256) as its own encoding does, so a root cannot hand the holders one
state and the others another, and a holder skips decoding and loading them.

Nothing the root sends is used before every rank has said it can take it: first its size
(within the memory this machine has available), then its bytes (they decode, and fit this
rank's state: ``State.check_shape``). After each, one small allgather of every rank's word, and
``judge_sync`` decides on every rank alike: all accepted, go on; else the root is blamed (it
could not send, or more of the others refused than accepted) or the refusers are (no more of
them than accepted: in a tie the refuser is blamed, so a hostile root facing one holder and one
newcomer gets the holder blamed, where before both would have loaded its bytes). The blamed
raise ``SyncRefusedError`` (no later world fixes it), the others ``BadPeerError`` naming one of
them, so ``elastic.run`` reports it and the rendezvous evicts it; nobody loads anything, and the
next world syncs from the best state among the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import zlib
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from elastic.ring.errors import ErrorKind
from elastic.ring.communicator import Communicator
from elastic.ring.errors import BadPeerError
from elastic.state.errors import SyncRefusedError

log = logging.getLogger("elastic")


def transfer(comm: Communicator, state: Any) -> Tuple[int, int]:
    """Makes every rank of ``comm`` hold the most advanced rank's commit (or rank 0's state
    before any), as the module doc says; returns (the root, the commit step every rank holds)."""
    rows = comm.allgather_equal(announcement(state))
    root = most_advanced(rows[:, :2])
    step = synced_step(int(rows[root, 0]), int(rows[root, 1]))
    holding = holders(rows, root)
    if len(holding) == comm.size:
        log.debug("sync in world version %d: every rank holds rank %d's state already; nothing sent",
                  comm.world_version, root)
        _adopt_live(comm, state, root, step)
        return root, step
    announced = tuple(rows[root, 2:].tolist())   # the length and CRC of what the root sends, or _NO_DIGEST
    encoded = failure = None
    if comm.rank == root:
        try:
            encoded = state.encode_for_sync(step, from_checkpoint=step < 0 and root == 0)
        except Exception as e:   # told to every rank below, then raised here
            failure = e

    def check_size(n: int) -> None:
        why = None
        if comm.rank != root:
            why = sync_size_problem(n, _memory_available())
            if why is not None:
                why = (f"rank {root}, which holds the most advanced commit ({step}), could not send its state; its "
                       "own error says why" if n == _CANNOT_SEND else f"rank {root} {why}")
            elif announced != _NO_DIGEST and n != announced[0]:
                why = f"rank {root} announced a state of {n} bytes, not the {announced[0]} of its digest"
        _agree(comm, root, step, why, own_error=failure)

    payload = comm.broadcast_encoded(encoded, root, check_size,
                                     announced=encoded.nbytes if encoded is not None else _CANNOT_SEND)
    held = comm.rank in holding
    why = None
    if comm.rank != root and announced != _NO_DIGEST and zlib.crc32(payload) != announced[1]:
        why = (f"sync in world version {comm.world_version}: the state rank {root} sent is not the one its digest "
               "announced")
    elif held and comm.rank != root:
        # The CRC only catches accidents: a root could forge one, so what the holders keep is
        # proved to be what the others load.
        own = state.encode_for_sync(step, from_checkpoint=False).hash_into(hashlib.sha256())
        if hashlib.sha256(payload).digest() != own.digest():
            why = (f"sync in world version {comm.world_version}: the state rank {root} sent is not the one this "
                   "rank holds, though its digest says it is")
    elif not held:
        try:
            got_step, snapshot = state.decode_synced(payload, root, comm.world_version)
            # Before any commit rank 0 sends its durable commit where there is one: any step then.
            if got_step != step and not (step < 0 and root == 0):
                why = (f"sync in world version {comm.world_version}: rank {root} sent commit {got_step}, not the "
                       f"{step} its standing announced")
        except Exception as e:   # whatever the root's bytes make the checks raise is the root's failure
            why = str(e)
    del payload
    _agree(comm, root, step, why)
    if held:
        _adopt_live(comm, state, root, step)
        return root, step
    try:
        state.adopt_synced(got_step, snapshot)
    except Exception as e:
        _cannot_load(comm, state, root, e)
    return root, got_step


def announcement(state: Any) -> np.ndarray:
    """This rank's row of the sync's first allgather: its standing, then its ``digest``."""
    return np.array([*state.standing(), *digest(state)], dtype=np.int64)


def _adopt_live(comm: Communicator, state: Any, root: int, step: int) -> None:
    try:
        state.adopt_live(step)
    except Exception as e:
        _cannot_load(comm, state, root, e)


def _cannot_load(comm: Communicator, state: Any, root: int, error: Exception) -> None:
    state.restore()
    raise SyncRefusedError(f"sync in world version {comm.world_version}: this rank could not load the state of rank "
                           f"{root} that every rank had checked ({type(error).__name__}: {error}); its last commit is "
                           "restored", world_version=comm.world_version, rank=comm.rank, peer=root) from error


_NO_DIGEST = (-1, -1)   # a state with no commit yet, one that cannot be encoded, or one a load would change


def digest(state: Any) -> Tuple[int, int]:
    """(length, CRC-32) of the bytes ``state`` would send as a sync root (its live state, as the
    commit its standing makes of it), which syncs compare to find the ranks that hold the root's
    state already; ``_NO_DIGEST`` before its first commit (a fresh state holds nothing worth
    keeping), when it cannot be encoded (a root then fails at sending it, naming why) or when
    loading it would change it (``State.loads_unchanged``). Contiguous CPU tensors are read in
    place, not copied."""
    commit, progress = state.standing()
    if commit < 0 or not state.loads_unchanged():
        return _NO_DIGEST
    try:
        encoded = state.encode_for_sync(synced_step(commit, progress), from_checkpoint=False)
    except Exception:
        return _NO_DIGEST
    crc = 0
    for chunk in encoded.chunks:
        crc = zlib.crc32(chunk, crc)
    return encoded.nbytes, crc


def holders(rows: np.ndarray, root: int) -> Tuple[int, ...]:
    """The ranks that hold the root's state already, from one row per rank of (commit step,
    steps kept since it, encoding length, CRC-32): those whose row is the root's, when the root
    has a commit and a digest. A peer that claims the root's row keeps its own state, which is
    all it could do anyway; it cannot make an honest rank skip a state it does not hold, and the
    honest holders check the root's bytes before they keep theirs."""
    mine = rows[root]
    if mine[0] < 0 or mine[2] < 0:
        return ()
    return tuple(r for r in range(len(rows)) if bool((rows[r] == mine).all()))


_CANNOT_SEND = -1   # what the root announces as its state's size when it cannot encode it


def synced_step(commit: int, progress: int) -> int:
    """The commit number a synced state is adopted as, from the root's standing: its commit, or
    a new one past it when it kept steps live since (every rank then holds that state as one
    commit, and a world that syncs again compares it as newer than any state kept from before)."""
    return commit + 1 if progress > 0 else commit


def most_advanced(standings: np.ndarray) -> int:
    """The sync root: the lowest rank among those furthest on, by (commit step, steps completed
    since it and kept live after a failure), one row per rank. After a failure the survivors may
    stand at different steps (one finished the gradient allreduce and stepped, another did not):
    the one that stepped holds the newer state, and every rank takes it."""
    order = np.lexsort((-np.arange(len(standings)), standings[:, 1], standings[:, 0]))
    return int(order[-1])


@dataclasses.dataclass(frozen=True)
class SyncVerdict:
    """What a world decided about one stage of a sync (every rank computes the same one)."""
    refused_by: Tuple[int, ...]   # ranks that did not accept (the root, when it could not send)
    blamed: Tuple[int, ...]       # () when all accepted; else the root alone, or the refusers


def judge_sync(root: int, accepted: Sequence[bool]) -> SyncVerdict:
    """Who is to blame in a sync stage where rank r said ``accepted[r]``. The root is blamed when
    it did not accept itself (it could not send) or when more of the other ranks refused than
    accepted: the bytes were the same for all, so most refusing means the bytes were bad. A
    minority that refused is blamed instead: what everyone else took does not fit its state.
    (Two ranks: the one that refused is believed.)"""
    refused = tuple(r for r, ok in enumerate(accepted) if not ok)
    if not refused:
        return SyncVerdict((), ())
    others_refused = sum(1 for r in refused if r != root)
    others_accepted = len(accepted) - 1 - others_refused
    if root in refused or others_refused > others_accepted:
        return SyncVerdict(refused, (root,))
    return SyncVerdict(refused, refused)


def sync_size_problem(size: int, available: int) -> Optional[str]:
    """Why a sync state of ``size`` bytes cannot be received here (None: it can): a size below
    zero, or more than the ``available`` bytes of memory this machine has now."""
    if size < 0:
        return f"announced a state of {size} bytes"
    if size > available:
        return f"announced a state of {size} bytes, more than the {available} bytes of memory available here"
    return None


def _memory_available() -> int:
    """Bytes of memory this machine can give now (MemAvailable; all of it when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _agree(comm: Communicator, root: int, step: int, why: Optional[str], own_error: Optional[Exception] = None) -> None:
    """One sync stage's verdict: every rank says whether it accepts (``why``: why not), and each
    raises what ``judge_sync`` decides for it, or returns when all accepted."""
    accepted = own_error is None and why is None
    words = comm.allgather_equal(np.array([1 if accepted else 0], dtype=np.int64))[:, 0]
    verdict = judge_sync(root, [w == 1 for w in words.tolist()])
    if not verdict.blamed:
        return
    version, me = comm.world_version, comm.rank
    where = dict(world_version=version, rank=me)
    if me in verdict.blamed:
        if own_error is not None:
            raise own_error
        others = [r for r in verdict.refused_by if r != me]
        if me == root:
            raise SyncRefusedError(f"sync in world version {version}: rank(s) {others} of {comm.size} refused the "
                                   f"state this rank sent as the most advanced (commit {step}); it does not fit "
                                   "theirs or cannot be received (their errors say why)", peer=root,
                                   refused_by=verdict.refused_by, **where)
        raise SyncRefusedError(f"sync in world version {version}: this rank refused the state rank {root} sent "
                               f"({why}), which the other ranks accepted: this worker's state does not fit the job's",
                               peer=root, refused_by=verdict.refused_by, **where)
    blamed = verdict.blamed[0]
    if why is None:
        why = (f"rank(s) {list(verdict.refused_by)} refused the state rank {root} sent" if blamed == root else
               f"rank {blamed} refused the state rank {root} sent, which the other ranks accepted: its state does not "
               "fit the job's")
    elif not why.startswith("sync in world version"):
        why = f"sync in world version {version}: {why}"
    raise BadPeerError(f"{why}; nothing was loaded", op="sync", peer=blamed, kind=ErrorKind.BadPeer, **where)
