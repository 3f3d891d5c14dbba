"""Deterministic inputs and numpy references for the collective correctness tests."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

import elastic

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
OPS = [elastic.Sum, elastic.Average, elastic.Min, elastic.Max]
FLOATS = {"float16", "bfloat16", "float32", "float64"}


def make_input(rank: int, dtype: str, count: int, op, exact: bool = True) -> torch.Tensor:
    """Rank's input. For floats with Sum/Average (exact=True) the values are small integers,
    so every summation order gives the same exact answer and the result can be compared
    bit for bit with a numpy reference."""
    rng = np.random.default_rng([rank, DTYPES.index(dtype), count, int(op), int(exact)])
    if dtype in FLOATS:
        if exact and op in (elastic.Sum, elastic.Average):
            vals = rng.integers(-8, 9, count).astype(np.float32)
        else:
            vals = rng.standard_normal(count).astype(np.float32)
        return torch.from_numpy(vals).to(getattr(torch, dtype))
    info = np.iinfo(dtype)
    if op == elastic.Average and dtype != "uint8":
        vals = rng.integers(-1000, 1001, count)
    else:
        vals = rng.integers(info.min, info.max, count, endpoint=True, dtype=np.int64 if dtype != "uint8" else np.uint8)
    return torch.from_numpy(np.asarray(vals).astype(dtype))


def reference(inputs: list, dtype: str, op) -> torch.Tensor:
    n = len(inputs)
    if dtype in FLOATS:
        stack = np.stack([t.to(torch.float64).numpy() for t in inputs])
        if op == elastic.Min:
            return torch.from_numpy(stack.min(axis=0)).to(getattr(torch, dtype))
        if op == elastic.Max:
            return torch.from_numpy(stack.max(axis=0)).to(getattr(torch, dtype))
        total = stack.sum(axis=0)  # exact: the inputs are small integers
        if op == elastic.Sum:
            return torch.from_numpy(total).to(getattr(torch, dtype))
        if dtype == "float64":
            return torch.from_numpy(total / n)
        # The core divides in float32 (float16/bfloat16 through float32), then rounds.
        return torch.from_numpy(total.astype(np.float32) / np.float32(n)).to(getattr(torch, dtype))
    stack = np.stack([t.numpy() for t in inputs])
    if op == elastic.Min:
        return torch.from_numpy(stack.min(axis=0))
    if op == elastic.Max:
        return torch.from_numpy(stack.max(axis=0))
    total = stack.sum(axis=0, dtype=dtype)  # wraps in the dtype, as the core does
    if op == elastic.Sum:
        return torch.from_numpy(total)
    wide = total.astype(np.int64)
    return torch.from_numpy((np.sign(wide) * (np.abs(wide) // n)).astype(dtype))


def raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes, for bit-for-bit comparison."""
    if t.numel() == 0:
        return b""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(raw(t)).hexdigest()
