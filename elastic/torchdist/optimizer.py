"""DistributedOptimizer: averages gradients over the current world while backward still runs.

Gradient hooks hand each parameter's gradient to a bucket (about ``bucket_bytes``, filled in
reverse registration order, roughly the order backward produces them). A full bucket is
submitted as fused async allreduces at once, so communication overlaps the rest of
backward; buckets are always launched in index order, so every rank issues the same
collectives in the same order. ``step()`` launches what is left (a parameter without a
gradient contributes zeros), waits, then runs the wrapped optimizer.

With ``backward_passes_per_step=N`` a parameter's gradient is reduced only after its N-th
backward pass (gradient accumulation). Work in flight belongs to one communicator: after a
re-form the bookkeeping of the old ring is dropped, never waited on.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from elastic.runtime import collectives
from elastic.ring.ops import Average, ReduceOp


class _DistributedMixin:
    def _elastic_setup(self, named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]], op: ReduceOp,
                       bucket_bytes: int, backward_passes_per_step: int = 1) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        for h in getattr(self, "_elastic_hooks", []):
            h.remove()
        self._elastic_args = (named_parameters, op, bucket_bytes, backward_passes_per_step)
        self._elastic_synchronized = False   # inside step(), past synchronize()
        self._elastic_passes = backward_passes_per_step
        seen: set = set()
        params = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:  # a shared parameter is reduced once
                    seen.add(id(p))
                    params.append(p)
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
        self._elastic_comm = None
        self._elastic_reset()
        self._elastic_hooks = [p.register_post_accumulate_grad_hook(self._elastic_hook) for p in params]

    def _elastic_check_ring(self):
        comm = collectives.current_communicator()
        if comm is not self._elastic_comm:
            self._elastic_reset()  # a re-form: whatever the old ring had in flight is gone
            self._elastic_comm = comm
        return comm

    def _elastic_hook(self, p: torch.Tensor) -> None:
        self._elastic_check_ring()
        i = self._elastic_bucket_of[id(p)]
        count = self._elastic_passes_seen.get(id(p), 0) + 1
        if i < self._elastic_next:
            raise RuntimeError("DistributedOptimizer: a gradient was accumulated after its allreduce started; "
                               "call step() (or zero_grad()) between backward passes, or pass "
                               "backward_passes_per_step=N to accumulate N passes")
        self._elastic_passes_seen[id(p)] = count
        if count == self._elastic_passes:
            self._elastic_ready[i].add(id(p))
        while (self._elastic_next < len(self._elastic_buckets)
               and len(self._elastic_ready[self._elastic_next]) == len(self._elastic_buckets[self._elastic_next])):
            self._elastic_launch(self._elastic_next)

    def _elastic_launch(self, i: int) -> None:
        comm = self._elastic_check_ring()
        for p in self._elastic_buckets[i]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._elastic_handles.append(comm.allreduce_async_(p.grad, self._elastic_op))
        comm.flush()  # start this bucket now rather than at synchronize()
        self._elastic_next = i + 1

    def synchronize(self) -> None:
        """Launches any bucket not yet launched and waits for every gradient allreduce."""
        try:
            self._elastic_check_ring()
            while self._elastic_next < len(self._elastic_buckets):
                self._elastic_launch(self._elastic_next)
            for h in self._elastic_handles:
                collectives.synchronize(h)
        finally:
            self._elastic_reset()

    def _elastic_reset(self) -> None:
        self._elastic_handles = []
        self._elastic_ready = [set() for _ in self._elastic_buckets]
        self._elastic_passes_seen: Dict[int, int] = {}
        self._elastic_next = 0

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_elastic_args"):  # not during the wrapped optimizer's own __init__
            named, op, bucket_bytes, passes = self._elastic_args
            self._elastic_setup(None, op, bucket_bytes, passes)  # hooks and buckets for the new ones too

    def step(self, closure=None):
        self.synchronize()
        # From here on parameters change: a TorchState's step hooks (which run around this
        # method and again around the wrapped optimizer's step) count only what follows.
        self._elastic_synchronized = True
        try:
            return super().step(closure)
        finally:
            self._elastic_synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients of an abandoned step (a failure mid-backward) must not be waited for.
        self._elastic_reset()
        return super().zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, op: ReduceOp = Average,
                         bucket_bytes: int = 4 << 20, backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
    """Wraps ``optimizer`` so ``step()`` uses gradients averaged (``op``) over the current world.

    Returns an instance of a subclass of the optimizer's own class, sharing its parameter
    groups and state, so schedulers and ``state_dict()`` work as before.
    """
    cls = type(optimizer.__class__.__name__, (_DistributedMixin, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    if hasattr(wrapped, "_patch_step_function"):
        wrapped._patch_step_function()  # what Optimizer.__init__ does: step hooks and profiling
    wrapped._elastic_setup(named_parameters, op, bucket_bytes, backward_passes_per_step)
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
