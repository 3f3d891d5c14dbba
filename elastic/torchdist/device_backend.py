"""A world's communicator for device tensors: the small interface, NCCL behind it, and gloo standing in on the CPU.

CPU tensors stay on the native ring. CUDA tensors run on a communicator made for one world
version only (``elastic.torchdist.device_world`` makes one per world and aborts it when the
world ends). This module is what such a communicator is: ``DeviceBackend`` runs a collective
(torch's own ``Backend`` methods, so the elastic group passes its calls through), waits for one
to finish, and aborts. Two implementations:

* ``nccl``: torch's ``ProcessGroupNCCL``, non-blocking (``config.blocking = False``, so every
  NCCL call returns at once and ``abort()`` from another thread ends what is in flight) and
  connected eagerly (``eager_connect_single_device``: the world pays for its connections when it
  forms, not in its first step). NCCL >= 2.26.2 is needed for an abort that does not hang
  (pytorch#149153), and torch's backend must have ``abort()``: ``nccl_problem`` checks both
  when the first one is made and names the versions found. torch's own watchdog must never end
  the worker (the world re-forms instead): ``NCCL_ENVIRONMENT`` is what is set before it is made.
* ``gloo``: torch's ``ProcessGroupGloo`` over the same store, standing in for NCCL on the CPU
  (``ELASTIC_DEVICE_BACKEND=gloo``: the tests and ``bench/gpu_check.py --cpu-dry-run``), whose
  device is then the CPU. gloo cannot interrupt a collective in flight: its ``abort()`` makes
  the elastic layer stop waiting (work still running ends at gloo's own timeout, the
  collective timeout), which is what the tests need of it; NCCL's ends the kernels.
"""

from __future__ import annotations

import datetime
import os
import threading
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from elastic.runtime.worker_config import DEVICE_BACKENDS

MIN_NCCL = (2, 26, 2)
KINDS = DEVICE_BACKENDS   # ELASTIC_DEVICE_BACKEND

# Set in the worker before its first NCCL communicator, so that torch's NCCL machinery never
# ends the worker or blocks it: the elastic layer watches every collective itself (the
# collective timeout, the rendezvous' abort) and aborts the communicator from a side thread.
NCCL_ENVIRONMENT: Dict[str, str] = {
    # 0: the watchdog neither aborts the communicator nor tears the process down on an error or
    # a timeout (its default, 3, kills the process; 1 and 2 abort on their own).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # wait() orders the caller's stream after the collective instead of spinning the CPU with a
    # timeout of its own; the elastic layer's watcher is the one that waits.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # The heartbeat monitor ends the process when the watchdog seems stuck (an abort in
    # progress, a CUDA call that waits), whatever the error handling says (pytorch#155916).
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # No flight-recorder dump (it writes files and waits) when a collective fails or times out.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # Errors stay local: no rank writes another's failure into the store (a store of a world).
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
}


def nccl_environment(env: Mapping[str, str], collective_timeout: float) -> Dict[str, str]:
    """The variables to set before the first NCCL communicator: ``NCCL_ENVIRONMENT`` (whatever
    ``env`` says: a value that lets the watchdog end the worker is replaced) and, unless ``env``
    has one, ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` (how long torch waits for a non-blocking NCCL
    call to leave its in-progress state) at the collective timeout."""
    out = dict(NCCL_ENVIRONMENT)
    if not env.get("TORCH_NCCL_NONBLOCKING_TIMEOUT"):
        out["TORCH_NCCL_NONBLOCKING_TIMEOUT"] = str(max(1, int(collective_timeout)))
    return out


def nccl_problem(nccl_version: Optional[Tuple[int, ...]], torch_version: str, has_abort: bool,
                 has_nonblocking: bool) -> Optional[str]:
    """Why NCCL communicators cannot be aborted here (None: they can): NCCL older than
    ``MIN_NCCL``, or a torch whose ``ProcessGroupNCCL`` lacks ``abort()`` or the non-blocking
    option. A pure function of what was found, so each case is a row of a test."""
    found = f"torch {torch_version}, NCCL " + (".".join(map(str, nccl_version)) if nccl_version else "not found")
    need = f"NCCL >= {'.'.join(map(str, MIN_NCCL))} (an abort that does not hang, pytorch#149153)"
    if nccl_version is None:
        return f"this torch has no NCCL ({found}); CUDA tensors need a CUDA build of torch with NCCL"
    if tuple(nccl_version) < MIN_NCCL:
        return f"{need} is required, found {found}: install a torch built with a newer NCCL"
    if not has_abort or not has_nonblocking:
        return (f"torch's ProcessGroupNCCL has no {'abort()' if not has_abort else 'non-blocking option'} "
                f"({found}): a torch >= 2.7 built with {need} is required")
    return None


def resolve_kind(kind: str, cuda_available: Callable[[], bool]) -> str:
    """The backend a world makes: ``auto`` is ``nccl`` where CUDA is available, else ``off``."""
    if kind not in KINDS:
        raise ValueError(f"ELASTIC_DEVICE_BACKEND={kind!r}: use one of {', '.join(KINDS)}")
    if kind == "auto":
        return "nccl" if cuda_available() else "off"
    return kind


class DeviceBackend:
    """One world's communicator for the tensors of ``device_type`` (the interface).

    ``run(method, *args)`` starts a collective with torch ``Backend`` arguments and returns
    torch's ``Work``; ``finish(work)`` blocks until it is done (raises when it failed; it must
    return, or raise, once ``abort()`` ran); ``completion()`` is the context a finished
    collective's result is handed on in; ``abort()`` ends what is in flight (called from a
    side thread; it may block, its caller bounds it)."""

    name = "device"
    device_type = "cuda"
    native_average = False     # ReduceOp.AVG runs as it is (else: divided before a SUM)

    def __init__(self, world_version: int, rank: int, size: int) -> None:
        self.world_version, self.rank, self.size = world_version, rank, size

    def connect(self) -> None:
        """Connects every rank now (blocking; ``abort()`` from another thread ends it)."""

    def run(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def finish(self, work: Any) -> None:
        raise NotImplementedError

    def completion(self) -> Any:
        return _NoContext()

    def abort(self) -> None:
        raise NotImplementedError

    def close(self) -> Optional[threading.Thread]:
        """Drops what it holds (after ``abort()``, or for a world that ended cleanly); returns the
        thread still releasing it, if any (joined, bounded, before the process may exit)."""
        return None


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class TorchBackend(DeviceBackend):
    """A torch c10d ``Backend`` (``ProcessGroupNCCL`` or ``ProcessGroupGloo``) as a ``DeviceBackend``."""

    def __init__(self, name: str, device_type: str, backend: Any, store: Any, world_version: int, rank: int,
                 size: int, *, native_average: bool, connect: Optional[Callable[[], None]] = None,
                 side_stream: Any = None) -> None:
        super().__init__(world_version, rank, size)
        self.name, self.device_type, self.native_average = name, device_type, native_average
        self._backend = backend
        self._store = store   # kept for the backend's life: NCCL may meet again over it
        self._connect = connect
        self._side = side_stream   # NCCL: where finished collectives are waited for and handed on

    def connect(self) -> None:
        if self._connect is not None:
            self._connect()

    def run(self, method: str, *args: Any) -> Any:
        return getattr(self._backend, method)(*args)

    def finish(self, work: Any) -> None:
        if self._side is None:
            work.wait()   # gloo: blocks (without the GIL) until done or failed
            return
        with torch.cuda.stream(self._side):
            work.wait()   # the side stream waits for the collective; raises when it failed already
            done = torch.cuda.Event(blocking=True)   # the thread sleeps instead of spinning a core
            done.record(self._side)
        done.synchronize()
        with torch.cuda.stream(self._side):
            work.wait()   # a failure torch's watchdog found while it ran

    def completion(self) -> Any:
        # A CUDA-aware future completed here records its event on the side stream, which has
        # waited for the collective: whoever waits on it waits for the collective, nothing else.
        return torch.cuda.stream(self._side) if self._side is not None else _NoContext()

    def abort(self) -> None:
        backend = self._backend
        if backend is not None:
            backend.abort()

    def close(self) -> Optional[threading.Thread]:
        # Dropped on a thread of its own: an aborted gloo backend's destructor waits for the
        # collectives still in its threads (to gloo's timeout), which no world change may wait
        # for. The process must not exit while it runs (std::terminate): DeviceWorlds joins it.
        held = [self._backend, self._store]
        self._backend = self._store = None
        release = threading.Thread(target=held.clear, name="elastic-device-release", daemon=True)
        release.start()
        return release


def make_gloo(store: Any, world_version: int, rank: int, size: int, timeout: float) -> TorchBackend:
    """gloo over ``store``, standing in for NCCL on the CPU; connects as it is made."""
    backend = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout))
    return TorchBackend("gloo", "cpu", backend, store, world_version, rank, size, native_average=False)


def make_nccl(store: Any, world_version: int, rank: int, size: int, timeout: float,
              env: Optional[Dict[str, str]] = None) -> TorchBackend:
    """A non-blocking NCCL communicator over ``store`` on this process's current CUDA device,
    connected by ``connect()``. Raises ``RuntimeError`` naming the versions where NCCL's abort
    cannot be relied on."""
    check_nccl()
    target = os.environ if env is None else env
    for name, value in nccl_environment(target, timeout).items():
        if target.get(name, value) != value and name in NCCL_ENVIRONMENT:
            warnings.warn(f"elastic: {name}={target[name]} would let torch's NCCL watchdog end or block the worker; "
                          f"set to {value} (the elastic layer aborts NCCL communicators itself)", stacklevel=2)
        target[name] = value
    from torch.distributed import ProcessGroupNCCL   # a CUDA build of torch: check_nccl() said so
    opts = ProcessGroupNCCL.Options()
    opts.config.blocking = False
    # torch's own per-collective timeout stays out of the way: the elastic layer's fires first.
    opts._timeout = datetime.timedelta(seconds=timeout + 600)
    opts.global_ranks_in_group = list(range(size))   # the group is the whole world, in rank order
    backend = ProcessGroupNCCL(store, rank, size, opts)
    backend._set_sequence_number_for_group()   # ranks agree on collective numbers (the flight recorder's)
    device = torch.device("cuda", torch.cuda.current_device())
    return TorchBackend("nccl", "cuda", backend, store, world_version, rank, size, native_average=True,
                        connect=lambda: backend.eager_connect_single_device(device),
                        side_stream=torch.cuda.Stream(device))


def check_nccl() -> None:
    """Raises ``RuntimeError`` (naming the versions found) unless NCCL communicators can be
    aborted here; called when the first NCCL communicator is made, so the CPU path never needs it."""
    pg = getattr(dist, "ProcessGroupNCCL", None) if dist.is_nccl_available() else None
    version = None
    if pg is not None:
        try:
            version = tuple(torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 (a torch without NCCL's library answers with an error)
            version = None
    has_nonblocking = False
    if pg is not None:
        try:
            has_nonblocking = hasattr(pg.Options().config, "blocking")
        except Exception:  # noqa: BLE001
            has_nonblocking = False
    problem = nccl_problem(version, torch.__version__, pg is not None and hasattr(pg, "abort"), has_nonblocking)
    if problem is not None:
        raise RuntimeError(f"elastic: CUDA tensors need an abortable NCCL communicator: {problem}")


__all__ = ["DeviceBackend", "KINDS", "MIN_NCCL", "NCCL_ENVIRONMENT", "TorchBackend", "check_nccl", "make_gloo",
           "make_nccl", "nccl_environment", "nccl_problem", "resolve_kind"]
