"""``elastic.DistributedDataParallel``: torch DDP whose gradient allreduce runs on the elastic ring.

The gradient allreduce must overlap backward, so it is the one asynchronous path on the ring:
it runs in a comm hook, whose failed future torch turns into a ``RuntimeError`` from
``backward()`` (DDP survives it); the ring's error is kept by the elastic group
(``elastic.torchdist.group.pending_failure``) and ``elastic.run`` handles what escaped the training
function as that ``WorkerLostError``.

DDP rebuilds its gradient buckets in its second iteration, in the order gradients became ready,
and broadcasts rank 0's order. After a re-form a joiner's DDP is new and a survivor's has
rebuilt: the first iteration would reduce different parameters in the same bucket slots, and the
joiner's rebuild broadcast would meet the others' allreduce. So at every sync every
``DistributedDataParallel`` builds a fresh reducer (``after_sync``), and all ranks, joiners
included, start from the same buckets and rebuild together.
"""

from __future__ import annotations

import gc
import hashlib
import queue
import threading
import warnings
import weakref
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.runtime import hooks, world
from elastic.ring.errors import WorkerLostError
from elastic.torchdist.group import _not_compiled, process_group
from elastic.torchdist.group_collectives import NATIVE
from elastic.ring.ops import Average
from elastic.state.states import training_forward_begins

# Every live DistributedDataParallel, in the order they were made: the same order on every rank
# (the same script makes them), which the broadcasts at sync rely on.
_ddps: "List[weakref.ref]" = []
_ddps_lock = threading.Lock()


def _live_ddps() -> "List[DistributedDataParallel]":
    with _ddps_lock:
        live = [(r, r()) for r in _ddps]
        _ddps[:] = [r for r, d in live if d is not None]
        return [d for _, d in live if d is not None]


class _Completions:
    """Completes DDP's bucket futures in order as the ring finishes their allreduces, on one
    thread, so backward goes on computing while the ring moves the earlier buckets."""

    def __init__(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def put(self, comm, handle, fut: torch.futures.Future, buf: torch.Tensor) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="elastic-ddp-completions", daemon=True)
                self._thread.start()
        self._q.put((comm, handle, fut, buf))

    def _loop(self) -> None:
        while True:
            comm, handle, fut, buf = self._q.get()
            try:
                comm.synchronize(handle)   # bounded by the ring's collective timeout or an abort
            except WorkerLostError as e:
                process_group()._record(e)
                fut.set_exception(RuntimeError(f"elastic ring: {e}"))
            except Exception as e:  # the future must finish, or DDP's backward waits forever
                fut.set_exception(RuntimeError(f"elastic ring: gradient allreduce failed: {e}"))
            else:
                fut.set_result(buf)


_completions = _Completions()


@_not_compiled
def _allreduce_hook(_state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's comm hook: the bucket averaged over the current world, asynchronously."""
    buf = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future()
    try:
        comm = world.ring()
        if buf.dtype not in NATIVE:
            raise NotImplementedError(f"DistributedDataParallel: gradients of dtype {buf.dtype} are not supported "
                                      "by the elastic ring")
        handle = comm.allreduce_async_(buf, Average)
        # Its own operation: the core fuses open async allreduces until something waits, and
        # the completion thread waits at times of its own, so fusing would differ by rank.
        comm.flush()
    except WorkerLostError as e:
        process_group()._record(e)
        fut.set_exception(RuntimeError(f"elastic ring: {e}"))
        return fut
    except Exception as e:
        fut.set_exception(RuntimeError(f"elastic ring: {e}"))
        return fut
    _completions.put(comm, handle, fut, buf)
    return fut


def _forward_begins(ddp: "DistributedDataParallel", args: Any) -> None:
    training_forward_begins(ddp.module)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` whose gradient allreduce runs on the
    elastic ring: averaged over the current world, re-formed with it.

    Takes DDP's keyword arguments except ``process_group`` (always ``elastic.process_group()``),
    ``init_sync`` (parameters and buffers are synced by ``elastic.run`` at every sync, from the
    rank holding the most advanced commit, not at construction) and ``mixed_precision``; the
    module's parameters must be on the CPU. Build it before ``elastic.run`` (no ring is needed).
    ``register_comm_hook`` is taken: the ring's allreduce is the hook.
    """

    def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
        refused = {
            "process_group": "the process group is the elastic ring's",
            "device_mesh": "the process group is the elastic ring's",
            "init_sync": "parameters and buffers are synced by elastic.run at every sync",
            "mixed_precision": "its comm hook would replace the ring's",
            "delay_all_reduce_named_params": "it broadcasts at construction, before any ring exists",
        }
        for name, why in refused.items():
            value = kwargs.pop(name, None)
            if value not in (None, False, []):
                raise ValueError(f"elastic.DistributedDataParallel: {name}= is not supported ({why})")
        dynamo = getattr(getattr(torch, "_dynamo", None), "config", None)
        if getattr(dynamo, "optimize_ddp", None) == "python_reducer":
            raise NotImplementedError("elastic.DistributedDataParallel: torch._dynamo.config.optimize_ddp="
                                      "'python_reducer' (compiled autograd) needs functional collectives, which "
                                      "the elastic group does not have; keep the default ('ddp_optimizer')")
        for p in module.parameters():
            if p.device.type != "cpu":
                raise NotImplementedError("elastic.DistributedDataParallel: the elastic ring moves CPU tensors; "
                                          f"this module has a parameter on {p.device}")
        if kwargs.get("device_ids"):
            raise NotImplementedError("elastic.DistributedDataParallel: device_ids= needs a GPU data plane, "
                                      "which the elastic ring does not have yet")
        super().__init__(module, process_group=process_group(), init_sync=False, **kwargs)
        dist._register_comm_hook(self.reducer, None, _allreduce_hook)
        # A TorchState holding the wrapped module learns that a training forward begins before
        # DDP broadcasts the buffers (a collective a peer's failure may surface in).
        self.register_forward_pre_hook(_not_compiled(_forward_begins))
        with _ddps_lock:
            _ddps.append(weakref.ref(self))

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise NotImplementedError("elastic.DistributedDataParallel runs the elastic ring's allreduce as its "
                                  "comm hook; another hook cannot be registered")

    def _elastic_reset(self) -> None:
        """A fresh reducer, as at construction: every rank's buckets are the same again, and
        they rebuild together (see the module doc). Also clears what a failed backward left."""
        self.reducer._remove_autograd_hooks()
        parameters, expect_sparse_gradient = self._build_params_for_reducer()
        mapping = self._build_debug_param_to_name_mapping(parameters)
        static = bool(self.static_graph)   # given to the constructor, or _set_static_graph() later
        self._ddp_init_helper(parameters, expect_sparse_gradient, mapping, static)
        dist._register_comm_hook(self.reducer, None, _allreduce_hook)
        self._has_rebuilt_buckets = False
        if static:
            # torch's own switch, so the new reducer's first iteration is a static graph's first
            # (it would otherwise skip the delayed allreduce, leaving each rank its own gradients).
            self.static_graph = False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # its find_unused_parameters note, said at construction
                self._set_static_graph()

    def _elastic_broadcast(self, root: int) -> None:
        tensors = [p.detach() for _, p in self.module.named_parameters()
                   if _ not in self.parameters_to_ignore]
        tensors += [b.detach() for _, b in self.module.named_buffers() if _ not in self.parameters_to_ignore]
        if tensors:
            with torch.no_grad():
                dist._broadcast_coalesced(process_group(), tensors, self.broadcast_bucket_size, root)


def _covered(state: Any, ddp: DistributedDataParallel) -> bool:
    """Whether the state carries this DDP's module (as its model or any attribute)."""
    held = getattr(state, "__dict__", {}).values()
    return any(v is ddp or v is ddp.module for v in held)


def _signature(ddps: Sequence[DistributedDataParallel]) -> int:
    """A number every rank must agree on before the DDPs outside the state are broadcast: how
    many, and each one's tensors (sizes, dtypes), in order."""
    h = hashlib.sha256()
    for ddp in ddps:
        h.update(b"ddp")
        for t in list(ddp.module.parameters()) + list(ddp.module.buffers()):
            h.update(f"{t.numel()}:{t.dtype};".encode())
    return int.from_bytes(h.digest()[:7], "little")


def after_sync(state: Any, root: int) -> None:
    """Called on every rank at the end of each sync (a step hook, after the group's own): the
    ring is new or kept, the state is everyone's. Each DDP's module the state does not carry gets
    the root's parameters and buffers, and every DDP a fresh reducer.

    One 16-byte allgather first checks that every rank has the same DDPs outside the state: a
    DDP one rank made and another did not would otherwise take another module's weights."""
    ddps = _live_ddps()
    outside = [d for d in ddps if not _covered(state, d)]
    if outside:
        gc.collect()   # a DDP dropped since (built in an earlier attempt) must not count on this rank only
        ddps = _live_ddps()
        outside = [d for d in ddps if not _covered(state, d)]
    comm = world.ring()
    mine = torch.tensor([len(outside), _signature(outside)], dtype=torch.int64)
    rows = comm.allgather_equal(mine).tolist()
    if any(row != rows[0] for row in rows):
        raise ValueError("elastic.DistributedDataParallel: the ranks hold different DDP modules outside the state "
                         f"(count and shape signature by rank: {rows}); make the same DDPs, in the same order, on "
                         "every worker, or hold their modules in the State")
    for ddp in outside:
        ddp._elastic_broadcast(root)
    for ddp in ddps:
        ddp._elastic_reset()


class _DDPHooks(hooks.StepHooks):
    def after_sync(self, state: Any, root: int) -> None:
        after_sync(state, root)


hooks.add_hooks(_DDPHooks())   # after the group's (imported above), on every rank that imports this module


__all__ = ["DistributedDataParallel", "after_sync"]
