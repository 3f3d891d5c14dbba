"""DistributedOptimizer: averages gradients over the current world while backward still runs.

Gradient hooks hand each parameter's gradient to a bucket (about ``bucket_bytes``, filled in
reverse registration order, roughly the order backward produces them). A full bucket is
submitted as fused async allreduces at once, so communication overlaps the rest of
backward; buckets are always launched in index order, so every rank issues the same
collectives in the same order. ``step()`` launches what is left (a parameter without a
gradient contributes zeros), waits, then runs the wrapped optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from . import collectives
from .ops import Average, ReduceOp


class _DistributedMixin:
    def _elastic_setup(self, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]], op: ReduceOp,
                       bucket_bytes: int) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if named_parameters is not None:
            named = list(named_parameters)
            names = {id(p): n for n, p in named}
            missing = [p for p in params if id(p) not in names]
            if missing:
                raise ValueError(f"DistributedOptimizer: {len(missing)} optimizer parameter(s) are not in "
                                 "named_parameters")
        self._elastic_op = ReduceOp(op)
        buckets: List[List[torch.Tensor]] = [[]]
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        self._elastic_buckets = [b for b in buckets if b]
        self._elastic_bucket_of = {id(p): i for i, b in enumerate(self._elastic_buckets) for p in b}
        self._elastic_handles: List[Any] = []
        self._elastic_ready: List[set] = [set() for _ in self._elastic_buckets]
        self._elastic_next = 0  # the next bucket to launch
        self._elastic_hooks = [p.register_post_accumulate_grad_hook(self._elastic_hook) for p in params]

    def _elastic_hook(self, p: torch.Tensor) -> None:
        i = self._elastic_bucket_of[id(p)]
        self._elastic_ready[i].add(id(p))
        while (self._elastic_next < len(self._elastic_buckets)
               and len(self._elastic_ready[self._elastic_next]) == len(self._elastic_buckets[self._elastic_next])):
            self._elastic_launch(self._elastic_next)

    def _elastic_launch(self, i: int) -> None:
        comm = collectives.current_communicator()
        for p in self._elastic_buckets[i]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._elastic_handles.append(comm.allreduce_async_(p.grad, self._elastic_op))
        comm.flush()  # start this bucket now rather than at synchronize()
        self._elastic_next = i + 1

    def synchronize(self) -> None:
        """Launches any bucket not yet launched and waits for every gradient allreduce."""
        try:
            while self._elastic_next < len(self._elastic_buckets):
                self._elastic_launch(self._elastic_next)
            for h in self._elastic_handles:
                collectives.synchronize(h)
        finally:
            self._elastic_reset()

    def _elastic_reset(self) -> None:
        self._elastic_handles = []
        self._elastic_ready = [set() for _ in self._elastic_buckets]
        self._elastic_next = 0

    def step(self, closure=None):
        self.synchronize()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients of an abandoned step (a failure mid-backward) must not be waited for.
        self._elastic_reset()
        return super().zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, op: ReduceOp = Average,
                         bucket_bytes: int = 4 << 20) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so ``step()`` uses gradients averaged (``op``) over the current world.

    Returns an instance of a subclass of the optimizer's own class, sharing its parameter
    groups and state, so schedulers and ``state_dict()`` work as before.
    """
    cls = type(optimizer.__class__.__name__, (_DistributedMixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    if hasattr(wrapped, "_patch_step_function"):
        wrapped._patch_step_function()  # what Optimizer.__init__ does: step hooks and profiling
    wrapped._elastic_setup(named_parameters, op, bucket_bytes)
    return wrapped


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrites parameters/buffers on every rank with ``root_rank``'s: a ``state_dict()``,
    ``named_parameters()`` or a list of (name, tensor)."""
    items = sorted(params.items()) if isinstance(params, dict) else sorted(params, key=lambda kv: kv[0])
    with torch.no_grad():
        for _, t in items:
            if not t.is_contiguous():
                raise ValueError("broadcast_parameters: parameters must be contiguous")
            collectives.broadcast_(t, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Makes every rank's optimizer state (and hyper-parameters) equal to ``root_rank``'s."""
    sd = collectives.broadcast_object(optimizer.state_dict() if collectives.current_communicator().rank == root_rank
                                      else None, root_rank)
    if collectives.current_communicator().rank != root_rank:
        optimizer.load_state_dict(sd)
