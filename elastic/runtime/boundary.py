"""The membership check at a commit boundary: each rank's row, and the verdict every rank reaches alike on them.

At every commit each rank writes one row of its own, the same width on every rank, and one
allgather gives every rank every row (``Session.check_membership``). A rank writes only what it
knows of itself: the world version it knows a clean change to be pending for (0: none), whether it
leaves at this commit, its compute and wait seconds of the open straggler window
(``elastic.runtime.straggler_detector``), and whether its training function returned. A rank
whose function returned writes the same row once more, as its last collective of the run
(``Session.check_return``): when every rank's row says so, the world returned together. Nothing one rank writes is taken for the world: the rows
are judged here, by a pure function every rank applies to the same rows, so all reach the same
verdict without another round trip (table-tested in tests/elastic/test_boundary.py).

Rules:

* A row no honest worker writes blames its rank: a change pending for another world than this
  one, a leave flag other than 0 or 1, timings that are negative or not finite, or more seconds
  than the window lasted (twice its wall time on the judging rank, read once the allgather
  completed there, plus a second: the windows of one world open at the same collective, and every
  rank measured before that allgather completed). Every other
  rank raises ``BadPeerError`` naming it (``Blame.IMPOSSIBLE_ROW``): reported, and evicted once the
  majority of the world did so.
* A rank that leaves says so for itself, and every rank switches at this commit: the leaver
  departs, the others form the next world without it. (A leave announced and not made is
  reported after a grace: ``Blame.FALSE_LEAVE``.)
* A pending change takes effect when more than half of the rows saw the server announce it. A
  rank that saw it early waits a commit or two for the others to see it too; a minority claiming
  it is outvoted, and a claim the server never announced is reported after a grace
  (``Blame.FALSE_PENDING``: the server checks it against what it announced).
* When every rank's function returned, the world is done (``Check.done``): each reports its
  success to the server, which completes the job once every member did at the same commit. A
  rank whose function returned while others train on leaves, as a leaver does: the others go on.
* The timings of every rank go to the straggler verdict, each rank's in its own row: no rank can
  write another's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import numpy as np

WIDTH = 5                             # a row: [pending version, leaving, compute s, wait s, returned]
PENDING, LEAVING, COMPUTE, WAIT, RETURNED = range(WIDTH)
WALL_SLACK_S = 1.0                    # what a window's timings may exceed twice its wall time by


def row(pending_version: int, leaving: bool, compute_s: float = 0.0, wait_s: float = 0.0,
        returned: bool = False) -> np.ndarray:
    """This rank's row: the world version it knows a clean change to be pending for (0: none),
    whether it leaves at this commit, its compute and wait seconds of the open window, whether
    its training function returned."""
    return np.array([float(pending_version), float(leaving), compute_s, wait_s, float(returned)], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Check:
    """The verdict on one commit's rows, the same on every rank that judged the same rows."""

    blamed: Tuple[Tuple[int, str], ...] = ()   # (rank, why) of rows no honest worker writes
    leavers: Tuple[int, ...] = ()              # ranks that leave at this commit (returned ones too)
    claimers: Tuple[int, ...] = ()             # ranks that saw a change pending for this world
    switch: bool = False                       # a change takes effect at this commit
    done: bool = False                         # every rank's function returned: the world's success
    compute: Tuple[float, ...] = ()            # each rank's compute seconds of the open window
    wait: Tuple[float, ...] = ()               # and its wait seconds


def problem(values: Sequence[float], world_version: int, wall_s: Optional[float]) -> Optional[str]:
    """Why no honest worker writes this row in world ``world_version`` (None: one may), judged
    against ``wall_s``, the seconds the open window lasted on the judging rank (None: not known)."""
    pending, leaving, compute, wait, returned = (float(v) for v in values)
    if not all(math.isfinite(v) for v in (pending, leaving, compute, wait, returned)):
        return "a value that is not a finite number"
    if pending not in (0.0, float(world_version)):
        return f"a membership change pending for world version {pending:g}, not for its own {world_version}"
    if leaving not in (0.0, 1.0):
        return f"a leave flag of {leaving:g} (0 or 1)"
    if returned not in (0.0, 1.0):
        return f"a returned flag of {returned:g} (0 or 1)"
    if compute < 0 or wait < 0:
        return f"negative timings ({compute:g} s computing, {wait:g} s waiting)"
    if wall_s is not None and compute + wait > 2 * wall_s + WALL_SLACK_S:
        return (f"{compute + wait:.3g} s of computing and waiting in a commit window that lasted {wall_s:.3g} s "
                "here")
    return None


def judge(rows: np.ndarray, world_version: int, wall_s: Optional[float]) -> Check:
    """The verdict on every rank's row (``rows[r]`` is rank r's), as every rank reaches it."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, WIDTH)
    n = len(rows)
    blamed = tuple((r, why) for r in range(n) for why in (problem(rows[r], world_version, wall_s),) if why)
    if blamed:
        return Check(blamed=blamed)
    returned = tuple(r for r in range(n) if rows[r, RETURNED] == 1.0)
    if n and len(returned) == n:
        return Check(done=True, compute=tuple(rows[:, COMPUTE].tolist()), wait=tuple(rows[:, WAIT].tolist()))
    leavers = tuple(r for r in range(n) if rows[r, LEAVING] == 1.0 or rows[r, RETURNED] == 1.0)
    claimers = tuple(r for r in range(n) if world_version > 0 and rows[r, PENDING] == float(world_version))
    return Check(leavers=leavers, claimers=claimers, switch=bool(leavers) or 2 * len(claimers) > n,
                 compute=tuple(rows[:, COMPUTE].tolist()), wait=tuple(rows[:, WAIT].tolist()))
