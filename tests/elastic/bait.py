"""Planted pickles for the tests: bytes that create a marker file when something unpickles them.

Each test that delivers one first proves, with ``prove_it_bites``, that unpickling it really
does create the marker, so an absent marker afterwards means the bytes were never unpickled.
"""

from __future__ import annotations

import io
import os
import pickle


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
