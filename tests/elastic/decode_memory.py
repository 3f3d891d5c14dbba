"""Decodes a crafted worst-case payload of one value kind and prints, as JSON, the payload's
size and how far this process's peak memory (VmHWM) grew while ``serialization.loads`` ran.

Run as ``python decode_memory.py KIND MIB`` in a process of its own: the payload is a list of
as many of the cheapest encodings of KIND as fit in about MIB MiB (one long str or one dict for
the kinds named so), the most objects per payload byte that kind allows.
"""

from __future__ import annotations

import json
import struct
import sys

import numpy as np
import torch  # noqa: F401  (imported before measuring: the decoder needs it for tensor kinds)

from elastic.ring import serialization as S

U64 = struct.Struct("<Q")
ONE = {   # the cheapest encoding of one value of each kind
    "none": bytes([S.NONE]),
    "bool": bytes([S.TRUE]),
    "int": bytes([S.INT]) + (10 ** 6).to_bytes(8, "little"),
    "bigint": bytes([S.BIGINT]) + (1).to_bytes(4, "little") + b"\x01",
    "float": bytes([S.FLOAT]) + struct.pack("<d", 1.5),
    "complex": bytes([S.COMPLEX]) + struct.pack("<dd", 1.5, 2.5),
    "str": bytes([S.STR]) + U64.pack(0),
    "str5": bytes([S.STR]) + U64.pack(5) + b"abcde",
    "bytes": bytes([S.BYTES]) + U64.pack(0),
    "list": bytes([S.LIST]) + U64.pack(0),
    "tuple": bytes([S.TUPLE]) + U64.pack(0),
    "dict": bytes([S.DICT]) + U64.pack(0),
    "ordered_dict": bytes([S.ORDERED_DICT]) + U64.pack(0) + bytes([S.NONE]),
    "tensor": bytes([S.TENSOR, 3, 1]) + U64.pack(0) + U64.pack(0),
    "tensor_0d": bytes([S.TENSOR, 11, 0]) + U64.pack(1) + b"\x01",
    "array": bytes([S.NDARRAY, 11, 1]) + U64.pack(0) + U64.pack(0),
    "array_0d": bytes([S.NDARRAY, 11, 0]) + U64.pack(1) + b"\x01",
    "numpy_scalar": bytes([S.NP_SCALAR, 11, 1]),
    "size": bytes([S.SIZE, 0]),
    "dtype": bytes([S.DTYPE, 3]),
}
KINDS = sorted(ONE) + ["wide_str", "dict_entries", "ordered_dict_entries"]
HEADER = S.MAGIC + bytes([S.VERSION])


def payload(kind: str, target: int) -> bytes:
    if kind == "wide_str":   # ASCII and one code point past U+FFFF: 4 bytes a character once decoded
        data = b"a" * (target - 4) + "\U0001F680".encode()
        return HEADER + bytes([S.STR]) + U64.pack(len(data)) + data
    if kind in ("dict_entries", "ordered_dict_entries"):   # distinct int keys, None values
        n = target // 10
        keys = np.arange(n, dtype="<i8")
        entries = np.zeros(n, dtype=[("tag", "u1"), ("key", "<i8"), ("value", "u1")])
        entries["tag"], entries["key"], entries["value"] = S.INT, keys, S.NONE
        ordered = kind == "ordered_dict_entries"
        return (HEADER + bytes([S.ORDERED_DICT if ordered else S.DICT]) + U64.pack(n) + entries.tobytes()
                + (bytes([S.NONE]) if ordered else b""))
    one = ONE[kind]
    n = target // len(one)
    return HEADER + bytes([S.LIST]) + U64.pack(n) + one * n


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def main() -> None:
    kind, mib = sys.argv[1], float(sys.argv[2])
    data = payload(kind, int(mib * (1 << 20)))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # the peak so far (building the payload) is forgotten: VmHWM = VmRSS now
    before = _status("VmRSS")
    try:
        value = S.loads(data)
        outcome = f"decoded: {type(value).__name__}"
    except ValueError as e:
        outcome = f"refused: {e}"
    grown = _status("VmHWM") - before
    print(json.dumps({"kind": kind, "payload": len(data), "grown": grown, "outcome": outcome[:300]}))


if __name__ == "__main__":
    main()
