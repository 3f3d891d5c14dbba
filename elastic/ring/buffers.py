"""The buffers collectives take: what a torch tensor or numpy array must be to reach the native
core (CPU, contiguous, native byte order, writable where it is written), and views of them."""

from __future__ import annotations

from typing import Any

import numpy as np


def native_array(t: Any, what: str, *, read_only: bool = False):
    """The object handed to the core: a CPU, contiguous torch tensor or numpy array."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError(f"{what}: array must be C-contiguous (use np.ascontiguousarray)")
        if not t.dtype.isnative:
            raise ValueError(f"{what}: array has non-native byte order ({t.dtype}); use .astype(native dtype)")
        if not t.flags.writeable:
            if not read_only:
                raise ValueError(f"{what}: array is read-only")
            return t.copy()  # the core takes writable buffers; this one is only read
        return t
    torch = torch_module()
    if torch is not None and isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise ValueError(f"{what}: only CPU tensors are supported (got a tensor on {t.device})")
        if not t.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
        if not read_only and t.requires_grad and torch.is_grad_enabled():
            # Writing through .detach() would change a tensor autograd may still need, unseen.
            raise ValueError(f"{what}: in-place collective on a tensor that requires grad; "
                             "wrap it in torch.no_grad() or pass tensor.detach()")
        return t.detach()
    raise TypeError(f"{what}: expected a torch.Tensor or numpy.ndarray, got {type(t).__name__}")


def numel(a: Any) -> int:
    return int(a.size) if isinstance(a, np.ndarray) else a.numel()


def itemsize(a: Any) -> int:
    return a.itemsize if isinstance(a, np.ndarray) else a.element_size()


def as_bytes(a: Any) -> Any:
    """A flat uint8 view of a contiguous array or tensor (what a byte-moving collective takes)."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    return a.reshape(-1).view(torch_module().uint8)


def torch_module():
    try:
        import torch
    except ImportError:  # numpy-only installs still work
        return None
    return torch
