"""Planted pickles for the tests: bytes that create a marker file when something unpickles them.

Each test that delivers one first proves, with ``prove_it_bites``, that unpickling it really
does create the marker, so an absent marker afterwards means the bytes were never unpickled.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib


class _CreatesMarker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        # What an attacker's payload does: call a function of its choosing when loaded.
        return (os.mkdir, (self.path,))


def planted_pickle(marker: str) -> bytes:
    """A plain pickle (what ``pickle.loads`` and ``broadcast_object`` used to read)."""
    return pickle.dumps({"attrs": {"epoch": _CreatesMarker(marker)}}, protocol=pickle.HIGHEST_PROTOCOL)


def planted_torch_save(marker: str, step: int = 10 ** 9) -> bytes:
    """A ``torch.save`` file of a (step, snapshot) pair (what ``TorchState`` syncs and durable
    commits used to be read with, ``torch.load(weights_only=False)``)."""
    import torch
    buf = io.BytesIO()
    torch.save((step, {"attrs": {"epoch": _CreatesMarker(marker)}, "handlers": {}}), buf)
    return buf.getvalue()


def prove_it_bites(data: bytes, marker: str) -> None:
    """Unpickles ``data`` the way the old code did and checks that it created ``marker``; removes it."""
    import torch
    assert not os.path.exists(marker)
    if data[:2] == b"PK":  # a torch.save zip
        torch.load(io.BytesIO(data), weights_only=False)
    else:
        pickle.loads(data)
    assert os.path.isdir(marker), "the planted pickle must create its marker when unpickled"
    os.rmdir(marker)


def forge_crc32(data: bytes, offset: int, target: int) -> bytes:
    """``data`` with its 4 bytes at ``offset`` changed so that its CRC-32 is ``target``: what a
    hostile peer can do to any message, since CRC-32 is affine in the message's bits and 32 of
    them, chosen freely, reach every value (solved over GF(2))."""
    buf = bytearray(data)
    buf[offset:offset + 4] = bytes(4)
    base = zlib.crc32(buf)
    basis = {}   # highest set bit -> (CRC change, the window bits that make it)
    for i in range(32):
        flipped = bytearray(buf)
        flipped[offset + i // 8] ^= 1 << (i % 8)
        change, bits = zlib.crc32(flipped) ^ base, 1 << i
        for b in range(31, -1, -1):
            if not change >> b & 1:
                continue
            if b not in basis:
                basis[b] = (change, bits)
                break
            change, bits = change ^ basis[b][0], bits ^ basis[b][1]
    want, window = base ^ target, 0
    for b in range(31, -1, -1):
        if want >> b & 1:
            want, window = want ^ basis[b][0], window ^ basis[b][1]
    for i in range(32):
        if window >> i & 1:
            buf[offset + i // 8] ^= 1 << (i % 8)
    assert zlib.crc32(buf) == target
    return bytes(buf)
