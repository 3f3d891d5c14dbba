"""``elastic.DistributedDataParallel``: torch DDP whose gradient allreduce runs on the elastic ring
(CPU modules) or on the world's NCCL communicator (CUDA modules).

The gradient allreduce must overlap backward, so it is the one asynchronous path on the ring:
it runs in a comm hook whose state is the session (as TorchFT's hook gets its manager), and whose
failed future torch turns into a ``RuntimeError`` from ``backward()`` (DDP survives it); the ring's
error is noted by the session (``Session.note_failure``) and ``elastic.run`` handles what escaped
the training function as that ``WorkerLostError``.

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
import warnings
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.ring.errors import CollectiveMismatchError, WorkerLostError
from elastic.ring.ops import Average
from elastic.runtime import current
from elastic.state.states import training_forward_begins
from elastic.torchdist import device_layer
from elastic.torchdist.group import ElasticProcessGroup, _not_compiled, process_group
from elastic.torchdist.group_collectives import NATIVE

def _live_ddps(group: ElasticProcessGroup) -> "List[DistributedDataParallel]":
    """The DDPs made on ``group`` that still exist, in the order they were made: the same order on
    every rank (the same script makes them), which the broadcasts at sync rely on."""
    with group._lock:
        live = [(r, r()) for r in group.ddps]
        group.ddps[:] = [r for r, d in live if d is not None]
        return [d for _, d in live if d is not None]


def _completer(fut: torch.futures.Future, buf: torch.Tensor, session: Any, what: str) -> Callable:
    """What completes a bucket's future: its averaged buffer, or the failure, noted with the
    session (torch makes a RuntimeError of a failed future; elastic.run raises the noted failure)."""

    def done(error: Optional[BaseException]) -> None:
        if error is None:
            fut.set_result(buf)
            return
        # A mismatch too: the world compares what each rank called (a stale image's buckets differ).
        if isinstance(error, (WorkerLostError, CollectiveMismatchError)) and session is not None:
            session.note_failure(error)
        fut.set_exception(RuntimeError(f"{what}: {error}"))

    return done


@_not_compiled
def _allreduce_hook(session: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's comm hook, its state the session (``None`` before the first sync: the current one):
    the bucket averaged over the current world, asynchronously, completed in order by the
    session's ``completions`` thread while backward goes on. A bucket on the device of the
    world's device communicator (CUDA) goes there (``_device_allreduce``)."""
    buf = bucket.buffer()
    session = session if session is not None else current.session()
    layer = device_layer.layer_of(session)
    if (layer is not None and layer.device_type_now() == buf.device.type) or buf.device.type != "cpu":
        return _device_allreduce(session, layer, buf)
    fut: torch.futures.Future = torch.futures.Future()
    done = _completer(fut, buf, session, "elastic ring")

    try:
        if session is None:
            raise RuntimeError("no session: train inside the function @elastic.run runs")
        comm = session.ring("DistributedDataParallel")
        if buf.dtype not in NATIVE:
            raise NotImplementedError(f"DistributedDataParallel: gradients of dtype {buf.dtype} are not supported "
                                      "by the elastic ring")
        handle = comm.allreduce_async_(buf, Average)
        # Its own operation: the core fuses open async allreduces until something waits, and
        # the completion thread waits at times of its own, so fusing would differ by rank.
        comm.flush()
    except Exception as e:  # noqa: BLE001 (the future must fail, or backward waits forever)
        done(e)
        return fut
    session.completions.put(comm, handle, done)
    return fut


def _device_allreduce(session: Any, layer: Any, buf: torch.Tensor) -> torch.futures.Future:
    """The bucket averaged on the world's device communicator. Its future completes once the
    collective finished on the device as the watcher saw it (``elastic.torchdist.device_world``),
    not when it was queued: a peer lost in it fails ``backward()`` before the optimizer steps, so
    the live state is kept (nothing redone), as on the ring."""
    fut: torch.futures.Future = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    done = _completer(fut, buf, session, "elastic device communicator")

    try:
        if session is None or layer is None:
            raise NotImplementedError(f"DistributedDataParallel: gradients on {buf.device} need the world's device "
                                      "communicator, which runs inside the function @elastic.run runs")
        comm = session.ring("DistributedDataParallel")
        device = layer.current(comm, buf.device.type, "DistributedDataParallel")
        if device is None:
            raise NotImplementedError(f"DistributedDataParallel: gradients on {buf.device}, and this world has no "
                                      f"communicator for them (ELASTIC_DEVICE_BACKEND={layer.kind})")
        opts = dist.AllreduceOptions()
        if device.backend.native_average:
            opts.reduceOp = dist.ReduceOp.AVG
        else:
            buf.div_(device.backend.size)
            opts.reduceOp = dist.ReduceOp.SUM
        device.run("DistributedDataParallel", "allreduce", [buf], opts, done=done)
    except Exception as e:  # noqa: BLE001 (the future must fail, or backward waits forever)
        if not fut.done():
            done(e)
    return fut


def _forward_begins(ddp: "DistributedDataParallel", args: Any) -> None:
    s = current.session()
    if s is not None:
        training_forward_begins(s.state, ddp.module)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` whose gradient allreduce runs on the
    elastic ring: averaged over the current world, re-formed with it.

    Takes DDP's keyword arguments except ``process_group`` (always ``elastic.process_group()``),
    ``init_sync`` (parameters and buffers are synced by ``elastic.run`` at every sync, from the
    rank holding the most advanced commit, not at construction) and ``mixed_precision``. The
    module's parameters are all on the CPU (gradients averaged on the ring) or all on the
    worker's GPU (on the world's NCCL communicator: ``elastic-run`` gives each worker one GPU,
    so ``module.cuda()`` is right as written). Build it before ``elastic.run`` (no ring is needed).
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
        devices = {p.device.type for p in module.parameters()}
        if not devices <= {"cpu", "cuda"} or len(devices) > 1:
            raise NotImplementedError("elastic.DistributedDataParallel: the parameters must all be on the CPU (the "
                                      f"ring) or all on CUDA (the world's NCCL communicator); found {sorted(devices)}")
        group = process_group()
        super().__init__(module, process_group=group, init_sync=False, **kwargs)
        dist._register_comm_hook(self.reducer, current.session(), _allreduce_hook)
        # A TorchState holding the wrapped module learns that a training forward begins before
        # DDP broadcasts the buffers (a collective a peer's failure may surface in).
        self.register_forward_pre_hook(_not_compiled(_forward_begins))
        with group._lock:
            group.ddps.append(weakref.ref(self))

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise NotImplementedError("elastic.DistributedDataParallel runs the elastic ring's allreduce as its "
                                  "comm hook; another hook cannot be registered")

    def _elastic_reset(self, session: Any) -> None:
        """A fresh reducer, as at construction: every rank's buckets are the same again, and
        they rebuild together (see the module doc). Also clears what a failed backward left. Its
        comm hook runs on ``session``'s ring."""
        self.reducer._remove_autograd_hooks()
        parameters, expect_sparse_gradient = self._build_params_for_reducer()
        mapping = self._build_debug_param_to_name_mapping(parameters)
        static = bool(self.static_graph)   # given to the constructor, or _set_static_graph() later
        self._ddp_init_helper(parameters, expect_sparse_gradient, mapping, static)
        dist._register_comm_hook(self.reducer, session, _allreduce_hook)
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


def after_sync(session: Any, state: Any, root: int) -> None:
    """Called on every rank at the end of each sync (a step hook, after the group's own): the
    ring is new or kept, the state is everyone's. Each DDP's module the state does not carry gets
    the root's parameters and buffers, and every DDP a fresh reducer on ``session``'s ring.

    One 16-byte allgather first checks that every rank has the same DDPs outside the state: a
    DDP one rank made and another did not would otherwise take another module's weights."""
    group = process_group()
    ddps = _live_ddps(group)
    outside = [d for d in ddps if not _covered(state, d)]
    if outside:
        gc.collect()   # a DDP dropped since (built in an earlier attempt) must not count on this rank only
        ddps = _live_ddps(group)
        outside = [d for d in ddps if not _covered(state, d)]
    comm = session.ring("DistributedDataParallel")
    mine = torch.tensor([len(outside), _signature(outside)], dtype=torch.int64)
    rows = comm.allgather_equal(mine).tolist()
    if any(row != rows[0] for row in rows):
        raise ValueError("elastic.DistributedDataParallel: the ranks hold different DDP modules outside the state "
                         f"(count and shape signature by rank: {rows}); make the same DDPs, in the same order, on "
                         "every worker, or hold their modules in the State")
    for ddp in outside:
        ddp._elastic_broadcast(root)
    for ddp in ddps:
        ddp._elastic_reset(session)


__all__ = ["DistributedDataParallel", "after_sync"]
