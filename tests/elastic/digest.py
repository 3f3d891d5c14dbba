"""A bit-for-bit digest of training state, computed without elastic.ring.serialization (so the tests of
that format do not check it against itself). Imported by the tests and by job.py, which runs as a
script from this directory."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch


def bits_digest(value) -> str:
    """SHA-256 over types, dtypes, shapes, bytes and key order of a structure of state."""
    h = hashlib.sha256()

    def walk(v):
        h.update(type(v).__name__.encode())
        if isinstance(v, torch.Tensor):
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, np.ndarray):
            h.update(f"{v.dtype}{v.shape}".encode() + v.tobytes())
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k)
                walk(x)
        elif isinstance(v, (list, tuple)):
            h.update(str(len(v)).encode())
            for x in v:
                walk(x)
        elif isinstance(v, float):
            h.update(struct.pack("<d", v))
        else:
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()
