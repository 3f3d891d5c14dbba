"""Which collectives of the elastic group go to the world's device communicator, and the ``Work`` they return.

Every tensor collective of ``ElasticProcessGroup`` is marked ``@device_routed``: when its tensors
live on the device the session's current world has a communicator for (``elastic.torchdist.
device_layer``: CUDA and NCCL; the CPU when gloo stands in for it), it runs there, with torch's
own arguments passed through; otherwise the group's ring path runs, unchanged. A CUDA tensor in a
world without one raises, naming ``ELASTIC_DEVICE_BACKEND``. ``barrier`` stays on the ring
(it has no tensor; a ring barrier holds every rank's CPU, which is what a barrier is for).

What a device collective returns is a ``DeviceWork``: ``wait()`` keeps torch's NCCL semantics on
a GPU (the caller's stream waits, the CPU goes on) and raises the world's ``WorkerLostError``
once the communicator was aborted; its failures are noted by the session, as the ring's are, so
``elastic.run`` recovers from what torch made of them.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions   # not re-exported by torch.distributed

from elastic.ring.errors import WorkerLostError
from elastic.runtime import current
from elastic.torchdist.device_layer import layer_of
from elastic.torchdist.device_world import Pending, WorldDevice

_AVERAGE = dist.ReduceOp.AVG


def _first_tensor(value: Any, depth: int = 0) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor(v, depth + 1)
            if t is not None:
                return t
    return None


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _reduce_opts(opts: Any, kind: Any) -> Any:
    """torch's options of a reduction from what the call passed: options, a bare op, or None."""
    if isinstance(opts, kind):
        return opts
    out = kind()
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        out.reduceOp = opts
    return out


def _average_by_sum(device: WorldDevice, opts: Any, inputs: Sequence[torch.Tensor], what: str) -> Any:
    """A backend without a native average (gloo) sums inputs divided by the world's size first."""
    if device.backend.native_average or opts.reduceOp != _AVERAGE:
        return opts
    for t in inputs:
        if not t.is_floating_point() and not t.is_complex():
            raise NotImplementedError(f"{what}: ReduceOp.AVG of {t.dtype} tensors is not supported")
        t.div_(device.backend.size)
    out = type(opts)()
    out.reduceOp = dist.ReduceOp.SUM
    return out


def _plan(device: WorldDevice, what: str, method: str, args: tuple) -> List[Tuple[str, tuple]]:
    """The backend calls that carry out the group's ``method(*args)``: torch's own names and
    arguments, options made where the call passed none (or a bare op, or a root rank)."""
    if method in ("allreduce", "allreduce_coalesced"):
        tensors = [args[0]] if isinstance(args[0], torch.Tensor) else list(args[0])
        kind = dist.AllreduceOptions if method == "allreduce" else dist.AllreduceCoalescedOptions
        opts = _average_by_sum(device, _reduce_opts(args[1] if len(args) > 1 else None, kind), tensors, what)
        return [(method, (tensors, opts))]
    if method == "reduce":
        opts = args[1] if len(args) > 1 and args[1] is not None else dist.ReduceOptions()
        return [(method, (list(args[0]), _average_by_sum(device, opts, list(args[0]), what)))]
    if method == "broadcast":
        tensors = [args[0]] if isinstance(args[0], torch.Tensor) else list(args[0])
        opts = args[1] if len(args) > 1 else None
        if not isinstance(opts, dist.BroadcastOptions):
            root, opts = opts or 0, dist.BroadcastOptions()
            opts.rootRank = root
        return [(method, (tensors, opts))]
    if method in ("reduce_scatter", "_reduce_scatter_base"):
        opts = _reduce_opts(args[2] if len(args) > 2 else None, dist.ReduceScatterOptions)
        return [(method, (args[0], args[1], _average_by_sum(device, opts, _tensors(args[1]), what)))]
    if method == "reduce_scatter_tensor_coalesced":
        opts = _reduce_opts(args[2] if len(args) > 2 else None, dist.ReduceScatterOptions)
        opts = _average_by_sum(device, opts, list(args[1]), what)
        return [("_reduce_scatter_base", (o, i, opts)) for o, i in zip(args[0], args[1])]
    if method == "allgather_into_tensor_coalesced":
        opts = args[2] if len(args) > 2 and args[2] is not None else AllgatherOptions()
        return [("_allgather_base", (o, i, opts)) for o, i in zip(args[0], args[1])]
    defaults = {"allgather": (2, AllgatherOptions), "allgather_coalesced": (2, AllgatherOptions),
                "_allgather_base": (2, AllgatherOptions), "gather": (2, dist.GatherOptions),
                "scatter": (2, dist.ScatterOptions), "alltoall": (2, dist.AllToAllOptions),
                "alltoall_base": (4, dist.AllToAllOptions)}
    at, kind = defaults[method]
    args = tuple(args[:at]) + ((args[at] if len(args) > at and args[at] is not None else kind()),)
    return [(method, args)]


def _note(error: WorkerLostError) -> None:
    s = current.session()
    if s is not None:
        s.note_failure(error)


class DeviceWork(dist.Work):
    """The ``Work`` of a collective run on a world's device communicator (see the module doc)."""

    def __init__(self, device: WorldDevice, entries: Sequence[Pending], result: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._device = device
        self._entries = list(entries)
        self._result = list(result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        try:
            for entry in self._entries:
                self._device.wait(entry)
        except WorkerLostError as e:
            _note(e)
            raise
        return True

    def is_completed(self) -> bool:
        return all(e.finished.is_set() for e in self._entries)

    def is_success(self) -> bool:
        return self.is_completed() and all(e.error is None for e in self._entries)

    def exception(self):
        return next((e.error for e in self._entries if e.error is not None), None)

    def result(self) -> List[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        cuda = [t.device for t in self._result if t.is_cuda]
        fut: torch.futures.Future = torch.futures.Future(devices=sorted(set(cuda), key=str)) if cuda else \
            torch.futures.Future()
        remaining = [len(self._entries)]

        def done(error: Optional[BaseException]) -> None:
            if error is not None:
                if not fut.done():
                    fut.set_exception(error)
                return
            remaining[0] -= 1
            if remaining[0] == 0 and not fut.done():
                fut.set_result(self._result)

        if not self._entries:
            fut.set_result(self._result)
        for entry in self._entries:
            self._device.when_done(entry, done)
        return fut


def route(group: Any, what: str, method: str, args: tuple) -> Optional[DeviceWork]:
    """Runs ``method(*args)`` of ``group`` on the world's device communicator when its tensors
    belong there; None when the ring path is theirs."""
    t = _first_tensor(args)
    if t is None:
        return None
    layer = layer_of(current.session())
    on_cpu = t.device.type == "cpu"
    if layer is None or layer.device_type_now() != t.device.type:
        if on_cpu:
            return None
        raise NotImplementedError(
            f"torch.distributed {what} on the elastic group: a tensor on {t.device}, and this world has no "
            f"communicator for it (CUDA tensors run on each world's NCCL communicator: ELASTIC_DEVICE_BACKEND is "
            f"{layer.kind if layer is not None else 'not in effect outside elastic.run'}; README: Train on GPUs)")
    comm = group._ring(what)   # a stale world view raises StaleMeshError here
    try:
        device = layer.current(comm, t.device.type, what)
        if device is None:
            return None
        entries = [device.run(what, m, *a) for m, a in _plan(device, what, method, args)]
    except WorkerLostError as e:
        _note(e)
        raise
    return DeviceWork(device, entries, _tensors(args[0]) if args else [])


def device_routed(what: str) -> Callable:
    """Marks a tensor collective of the elastic group: run on the world's device communicator
    when its tensors belong there (``route``), else the method itself (the ring)."""
    def mark(fn: Callable) -> Callable:
        method = fn.__name__

        @functools.wraps(fn)
        def call(self, *args: Any, **kwargs: Any) -> Any:
            work = route(self, what, method, args) if not kwargs else None
            return work if work is not None else fn(self, *args, **kwargs)
        return call
    return mark


__all__ = ["DeviceWork", "device_routed", "route"]
