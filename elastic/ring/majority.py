"""Who differs from the majority of a world: a pure rule every rank applies alike to the same values.

Used where every rank holds every rank's value (the ring settings allgathered at ``connect``)
and a rank that differs must cost that rank, not the world (table-tested, every split of 3, 4
and 5 ranks, in tests/native/test_majority.py):

* All ranks agree: nobody differs.
* In a world of three or more, the ranks holding one value that more than half of the ranks
  hold are the majority; every other rank differs from it and is blamed.
* Without such a value (a world of two that disagrees, a three-way split, two halves) there is
  no majority to trust: nobody can be blamed, the world stops and says what each rank held.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Optional, Sequence, Tuple


def odd_ranks(values: Sequence[Hashable]) -> Optional[Tuple[int, ...]]:
    """The ranks whose value differs from the majority's (``()``: all agree), or None when the
    ranks disagree and no value is held by more than half of a world of three or more."""
    if len(set(values)) <= 1:
        return ()
    value, held = Counter(values).most_common(1)[0]
    if len(values) < 3 or 2 * held <= len(values):
        return None
    return tuple(r for r, v in enumerate(values) if v != value)
