"""Reduction operations for allreduce."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """How allreduce combines the ranks' values. Values match the native core."""

    Sum = 0
    Average = 1  # integers: the wrapped sum divided by size(), truncated toward zero
    Min = 2
    Max = 3


Sum = ReduceOp.Sum
Average = ReduceOp.Average
Min = ReduceOp.Min
Max = ReduceOp.Max
