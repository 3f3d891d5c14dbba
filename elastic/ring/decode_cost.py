"""What a decoded value of the object format takes in memory, and how much a payload may decode to.

``serialization`` charges every value it is about to make its cost here, before making it, and
refuses a payload whose charges pass ``budget(len(payload))``: a peer or a file cannot make a
small payload decode into a large heap. Costs are in bytes: the object (with its allocator's
rounding and GC header) and, for containers, a slot (8) or dict entry per element; the elements
are charged as values of their own. Measured as RSS growth per object over 10^5 of them
(CPython 3.11, torch 2.13) and rounded up. Singletons (None, bools, dtypes) cost nothing but
their slot. A tuple is built from a list, so both are charged.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

DECODE_RATIO = 4          # decoded values may take this many times the payload's bytes ...
DECODE_FLOOR = 16 << 20   # ... plus this many (small payloads of small values cost more than 4x)

INT, FLOAT, COMPLEX, NP_SCALAR = 32, 24, 32, 48
LIST, TUPLE, SLOT = 72, 56 + 72, 8
DICT, DICT_ENTRY = 232, 48
ORDERED_DICT, ORDERED_DICT_ENTRY = 400, 128
TENSOR, ARRAY, DIM = 640, 192, 16
STR, BYTES = 96, 48
SHORT_STR = 4096   # a longer str is charged from its bytes before it is made, a shorter one after


def budget(nbytes: int) -> int:
    """The bytes of memory the values decoded from ``nbytes`` bytes may take."""
    return DECODE_RATIO * nbytes + DECODE_FLOOR


def over_budget(cost: int, nbytes: int) -> str:
    """What a refusal says: the charges, the budget, and what to send instead."""
    return (f"values that take {cost} bytes of memory or more once decoded, over the {budget(nbytes)} that "
            f"{nbytes} encoded bytes may take ({DECODE_RATIO}x + {DECODE_FLOOR >> 20} MiB): many small values cost "
            "far more as Python objects than on the wire; hold them in a numpy array or a tensor")


def bigint(n: int) -> int:
    return INT + 2 * n


def str_(chars: int, width: int) -> int:
    """A str of ``chars`` code points stored ``width`` bytes each (1: Latin-1, 2, 4: CPython's
    compact forms)."""
    return STR + chars * width


def str_width(s: str) -> int:
    if not s or s.isascii():
        return 1
    top = ord(max(s))
    return 1 if top < 0x100 else 2 if top < 0x10000 else 4


def utf8_shape(data: Any) -> Tuple[int, int]:
    """(code points, width) of the str that valid UTF-8 ``data`` decodes to, read from its
    bytes without decoding: a code point per byte that is not a continuation (10xxxxxx); a lead
    byte 0xF0 or above means one past U+FFFF (width 4), 0xC4 or above one past U+00FF (2)."""
    b = np.frombuffer(data, dtype=np.uint8)
    chars = int(np.count_nonzero((b & 0xC0) != 0x80))
    top = int(b.max()) if b.size else 0
    return chars, 4 if top >= 0xF0 else 2 if top >= 0xC4 else 1


def sequence(is_list: bool, n: int) -> int:
    return LIST + SLOT * n if is_list else TUPLE + 2 * SLOT * n


def mapping(ordered: bool, n: int) -> int:
    return ORDERED_DICT + ORDERED_DICT_ENTRY * n if ordered else DICT + DICT_ENTRY * n


def size(ndim: int) -> int:
    return TUPLE + (2 * SLOT + INT) * ndim   # a torch.Size is made from a list of ints


def tensor(ndim: int, nbytes: int) -> int:
    return TENSOR + DIM * ndim + nbytes


def array(ndim: int, nbytes: int) -> int:
    return ARRAY + DIM * ndim + nbytes
