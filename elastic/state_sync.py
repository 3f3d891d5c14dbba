"""How a state travels at a sync: from the rank holding the most advanced commit to every rank.

The session runs it at every sync of its step protocol (``elastic.session``, which says when).
One allgather agrees on the most advanced state (``most_advanced``: the highest commit step,
then the most steps kept live since it); that rank (the lowest of them), the root, sends its
state, encoded by ``elastic.serialization``; every rank, the sender too, loads the same bytes,
so all hold the same bits afterwards.

Nothing the root sends is used before every rank has said it can take it: first its size
(within the memory this machine has available), then its bytes (they decode, and fit this
rank's state: ``State.check_shape``). After each, one small allgather of every rank's word, and
``judge_sync`` decides on every rank alike: all accepted, go on; else the root is blamed (it
could not send, or most of the others refused) or the refusers are (a minority). The blamed
raise ``SyncRefusedError`` (no later world fixes it), the others ``BadPeerError`` naming one of
them, so ``elastic.run`` reports it and the rendezvous evicts it; nobody loads anything, and the
next world syncs from the best state among the rest.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from ._native import ErrorKind
from .communicator import Communicator
from .errors import BadPeerError, SyncRefusedError


def transfer(comm: Communicator, state: Any) -> Tuple[int, int]:
    """Makes every rank of ``comm`` hold the most advanced rank's commit (or rank 0's state
    before any), as the module doc says; returns (the root, the commit step every rank holds)."""
    positions = comm.allgather_equal(np.array(state.sync_position(), dtype=np.int64))
    root = most_advanced(positions)
    step = synced_step(int(positions[root, 0]), int(positions[root, 1]))
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
        _agree(comm, root, step, why, own_error=failure)

    payload = comm.broadcast_encoded(encoded, root, check_size,
                                     announced=encoded.nbytes if encoded is not None else _CANNOT_SEND)
    try:
        got_step, snapshot = state.decode_synced(payload, root, comm.world_version)
        # Before any commit rank 0 sends its durable commit where there is one: any step then.
        announced = got_step == step or (step < 0 and root == 0)
        why = None if announced else (f"sync in world version {comm.world_version}: rank {root} sent commit "
                                      f"{got_step}, not the {step} its position announced")
    except Exception as e:   # whatever the root's bytes make the checks raise is the root's failure
        why = str(e)
    _agree(comm, root, step, why)
    try:
        state.adopt_synced(got_step, snapshot)
    except Exception as e:
        state.restore()
        raise SyncRefusedError(f"sync in world version {comm.world_version}: this rank could not load the state of "
                               f"rank {root} that every rank had checked ({type(e).__name__}: {e}); its last commit "
                               "is restored", world_version=comm.world_version, rank=comm.rank, peer=root) from e
    return root, got_step


_CANNOT_SEND = -1   # what the root announces as its state's size when it cannot encode it


def synced_step(commit: int, progress: int) -> int:
    """The commit number a synced state is adopted as, from the root's position: its commit, or
    a new one past it when it kept steps live since (every rank then holds that state as one
    commit, and a world that syncs again compares it as newer than any state kept from before)."""
    return commit + 1 if progress > 0 else commit


def most_advanced(positions: np.ndarray) -> int:
    """The sync root: the lowest rank among those furthest on, by (commit step, steps completed
    since it and kept live after a failure), one row per rank. After a failure the survivors may
    stand at different steps (one finished the gradient allreduce and stepped, another did not):
    the one that stepped holds the newer state, and every rank takes it."""
    order = np.lexsort((-np.arange(len(positions)), positions[:, 1], positions[:, 0]))
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
