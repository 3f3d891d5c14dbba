"""torch.distributed on the elastic ring: the one ProcessGroup that follows re-forms.

``process_group()`` is the process's one ``torch.distributed.ProcessGroup`` whose ``rank()`` and
``size()`` are the current world's and whose collectives run on the session's current ring, so
the object a library cached stays right across re-forms. Inside ``elastic.run`` it is the default
group (``install_default_group``): ``dist.get_rank()``, ``dist.all_reduce(t)`` … run on the ring.

Failures never vanish. Every collective runs synchronously and raises the ring's own
``WorkerLostError`` (``async_op=True`` hands back a finished ``Work``): torch loses the error of a
``Work`` whose future failed, and DDP's reducer crashes on one. The one asynchronous path is
DDP's gradient allreduce (``elastic.torchdist.ddp``), which must overlap backward. A ring error
any of them hits is noted by the session (``Session.note_failure``), and ``elastic.run`` handles
what escaped the training function as that ``WorkerLostError``. CUDA tensors run on the current
world's NCCL communicator instead (``elastic.torchdist.device_routing``), with torch's NCCL semantics. torch's object collectives (``all_gather_object`` …)
pickle; on this group they run in ``elastic.torchdist.objects`` instead, whose format calls nothing a peer
names and whose sizes are bounded.

FSDP2 and DTensor reach the group through a DeviceMesh, which fixes a world into what it shards:
the mesh holds the group's view of one world (``world_view()``, named ``elastic/world<version>``),
whose collectives raise ``StaleMeshError`` once that world is over (``elastic.torchdist.mesh``). The
gathers and reduce-scatters they call are the ring's own phases (``elastic.torchdist.group_collectives``).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.ring.errors import CollectiveMismatchError, WorkerLostError
from elastic.runtime import current, world
from elastic.runtime.errors import RendezvousError
from elastic.runtime.worker_config import default_group_from_env
from elastic.torchdist import c10d_tables, objects
from elastic.torchdist.device_routing import device_routed
from elastic.torchdist.errors import StaleMeshError
from elastic.torchdist.group_collectives import (NATIVE, WIDEN, Contiguous, all_gather_into_tensor, all_gather_list,
                                                 check_cpu, reduce_scatter_list, reduce_scatter_tensor, ring_op)

log = logging.getLogger("elastic")

GROUP_NAME = "elastic"
BACKEND = c10d_tables.BACKEND

_MAX_ALLTOALL_BYTES = 1 << 36   # every rank holds the whole exchange


def _reduce_op(opts: Any) -> Any:
    """The reduce op of a call: options from torch's functions, or an op passed by hand."""
    if opts is None:
        return dist.ReduceOp.SUM
    if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        return opts
    return opts.reduceOp


def _not_compiled(fn):
    """Keeps torch.compile from tracing into the ring (DDP's reducer calls the group's broadcast
    from inside a compiled forward when it rebuilds its buckets)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


class _Done(dist.Work):
    """A collective that already finished (every op runs synchronously; see the module doc)."""

    def __init__(self, result: Sequence[torch.Tensor] = ()):
        super().__init__()
        self._result = list(result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> List[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        pass

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor (what allgather and broadcast move)."""
    return t.detach().reshape(-1).view(torch.uint8)


class ElasticProcessGroup(dist.ProcessGroup, objects.RingGroup):
    """The current world as a ``torch.distributed.ProcessGroup`` (see the module doc).

    ``rank()``/``size()`` answer with the current world (after ``elastic.run`` returned: its
    last world); collectives run on ``elastic.runtime.world.ring()`` and raise what it raises:
    ``WorkerLostError`` on a peer failure, ``RendezvousError`` when no job runs.

    ``world_view()`` is the same group pinned to the current world, the group a DeviceMesh
    holds: its rank, size and name are that world's for good, and its collectives raise
    ``StaleMeshError`` once that world is over.
    """

    def __init__(self, *, world: Any = None, name: str = GROUP_NAME,
                 parent: "Optional[ElasticProcessGroup]" = None) -> None:
        # The C++ base's rank and size are never read through this object: every Python
        # caller gets the overrides below, and DDP's reducer (the one C++ user) takes its
        # divide factor from the comm hook, which averages over the current size.
        super().__init__(0, 1)
        self._lock = threading.Lock()
        self._world = world       # a world view's ring (its Communicator); None for the process's group
        self._name = name
        self._parent = parent     # a world view's process group
        self._view: "Optional[ElasticProcessGroup]" = None   # the process group's view of the current world
        self._view_names: set = set()
        self.ddps: List[weakref.ref] = []   # the DistributedDataParallels made on this group, in order
        self.meshes: dict = {}               # a world view's DeviceMeshes by device type (elastic.torchdist.mesh)

    # ------------------------------------------------------------------ identity
    @_not_compiled
    def rank(self) -> int:
        if self._world is not None:
            return self._world.rank
        where = world.position()
        return where[0] if where is not None else 0

    @_not_compiled
    def size(self) -> int:
        if self._world is not None:
            return self._world.size
        where = world.position()
        return where[1] if where is not None else 1

    def getBackendName(self) -> str:   # noqa: N802 (torch's name)
        return BACKEND

    @property
    def name(self) -> str:  # type: ignore[override]
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name torch.distributed resolves the group by. For the process's group, its
        current world view's (``elastic/world<version>``), so that a DeviceMesh made from it
        (``DeviceMesh.from_group``, ``init_device_mesh`` on the default group) belongs to that
        world; ``elastic`` when no ring is current."""
        if self._world is not None or world.current_ring() is None:
            return self._name
        return self.world_view().group_name

    def world_view(self) -> "ElasticProcessGroup":
        """This group pinned to the current world (made on first use in each world), entered
        in torch.distributed's tables under its own name, which stays resolvable after its
        world so that a stale mesh finds it and raises ``StaleMeshError``."""
        if self._world is not None:
            return self
        comm = self._ring("world_view")
        with self._lock:
            view = self._view
            if view is None or view._world is not comm:
                name, again = f"{GROUP_NAME}/world{comm.world_version}", 1
                while name in self._view_names:   # rings formed by hand can repeat a version
                    again += 1
                    name = f"{GROUP_NAME}/world{comm.world_version}-{again}"
                self._view_names.add(name)
                view = self._view = ElasticProcessGroup(world=comm, name=name, parent=self)
                # torch compares meshes by their ranks: DTensor's sharding caches would hand a
                # mesh made anew for this world (from_group) the last world's equal one.
                from torch.distributed.tensor.debug import _clear_sharding_prop_cache
                _clear_sharding_prop_cache()
            if c10d_tables.entered_as(view) != view.group_name:   # new, or destroy_process_group() emptied them
                c10d_tables.enter_world_view(view, lambda pg: isinstance(pg, ElasticProcessGroup) and
                                             pg._world is not None)
        return view

    def shutdown(self) -> None:
        """``dist.destroy_process_group()``: closes the ring kept for collectives after
        ``elastic.run`` returned; a running session's ring is the session's to close."""
        world.close_kept_ring()

    def abort(self) -> None:
        comm = world.current_ring()
        if comm is not None and (self._world is None or comm is self._world):
            comm.abort("torch.distributed ProcessGroup.abort()")

    # ------------------------------------------------------------------ failures
    def _note(self, err: WorkerLostError) -> None:
        """The session notes the ring failure a collective run for torch hit: torch turns it into
        an error of its own, and ``elastic.run`` raises this one in its place."""
        s = current.session()
        if s is not None:
            s.note_failure(err)

    def _ring(self, what: str):
        try:
            comm = world.ring()
        except RendezvousError as e:
            raise RendezvousError(f"torch.distributed {what} on the elastic group: {e}") from None
        if self._world is not None and comm is not self._world:
            raise StaleMeshError(
                f"torch.distributed {what} on the elastic group of world version {self._world.world_version} "
                f"({self._world.size} ranks), which is over: the world is now version {comm.world_version} "
                f"({comm.size} ranks). A DeviceMesh, and every FSDP module or DTensor made on it, belongs to one "
                "world: make them again in each world with elastic.device_mesh() (elastic.ShardedState does this "
                "for you)", world_version=self._world.world_version, current_world_version=comm.world_version)
        return comm

    def _run(self, fn, *args):
        """``fn(*args)``, the ring failure it raises noted by the session."""
        try:
            return fn(*args)
        except (WorkerLostError, CollectiveMismatchError) as e:   # a mismatch: the world compares the calls
            self._note(e)
            raise

    # ------------------------------------------------------------------ reductions
    def _allreduce_one(self, comm, t: torch.Tensor, op: Any, what: str) -> None:
        check_cpu(t, what)
        rop = ring_op(op, t.dtype, what)
        c = Contiguous(t)
        x = c.work.detach()
        if x.dtype == torch.bool:
            wide = x.to(torch.uint8)
            self._run(comm.allreduce_, wide, rop)
            x.copy_(wide.to(torch.bool))
        elif x.dtype.is_complex:
            self._run(comm.allreduce_, torch.view_as_real(x), rop)
        elif x.dtype in WIDEN:
            wide = x.to(torch.int64)
            self._run(comm.allreduce_, wide, rop)
            x.copy_(wide.to(x.dtype))
        elif x.dtype in NATIVE:
            self._run(comm.allreduce_, x, rop)
        else:
            raise NotImplementedError(f"{what}: dtype {x.dtype} is not supported by the elastic ring")
        c.done()

    @_not_compiled
    @device_routed("all_reduce")
    def allreduce(self, tensors, opts=None):
        what = "all_reduce"
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        comm = self._ring(what)
        for t in tensors:
            self._allreduce_one(comm, t, _reduce_op(opts), what)
        return _Done(tensors)

    @_not_compiled
    @device_routed("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors, opts=None):
        comm = self._ring("all_reduce_coalesced")
        op = _reduce_op(opts)
        for t in tensors:
            self._allreduce_one(comm, t, op, "all_reduce_coalesced")
        return _Done(tensors)

    @_not_compiled
    @device_routed("reduce")
    def reduce(self, tensors, opts=None):
        what = "reduce"
        comm = self._ring(what)
        root = opts.rootRank if opts is not None else 0
        op = _reduce_op(opts)
        for t in tensors:
            # Every rank reduces (the ring has no tree); only the root's tensor takes the result.
            target = t if comm.rank == root else t.detach().clone()
            self._allreduce_one(comm, target, op, what)
        return _Done(tensors)

    # The gathers and reduce-scatters FSDP2 and DTensor call are the ring's own phases
    # (elastic.torchdist.group_collectives), never built from allreduce.
    @_not_compiled
    @device_routed("reduce_scatter")
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        comm = self._ring("reduce_scatter")
        for out, inputs in zip(output_tensors, input_tensors):
            reduce_scatter_list(comm, self._run, out, inputs, _reduce_op(opts))
        return _Done(output_tensors)

    @_not_compiled
    @device_routed("reduce_scatter_tensor")
    def _reduce_scatter_base(self, output, input, opts=None):
        reduce_scatter_tensor(self._ring("reduce_scatter_tensor"), self._run, output, input, _reduce_op(opts))
        return _Done([output])

    @_not_compiled
    @device_routed("reduce_scatter_tensor_coalesced")
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        comm = self._ring("reduce_scatter_tensor_coalesced")
        if len(outputs) != len(inputs):
            raise ValueError(f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
        for o, i in zip(outputs, inputs):
            reduce_scatter_tensor(comm, self._run, o, i, _reduce_op(opts), "reduce_scatter_tensor_coalesced")
        return _Done(outputs)

    # ------------------------------------------------------------------ data movement
    @_not_compiled
    @device_routed("broadcast")
    def broadcast(self, tensors, opts=None):
        what = "broadcast"
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        comm = self._ring(what)
        root = opts.rootRank if opts is not None and not isinstance(opts, int) else (opts or 0)
        if not 0 <= root < comm.size:
            raise ValueError(f"{what}: root rank {root} is outside the world of {comm.size}")
        for t in tensors:
            check_cpu(t, what)
            c = Contiguous(t)
            if c.work.numel():
                self._run(comm.broadcast_, _bytes(c.work), root)
            c.done()
        return _Done(tensors)

    def _gather_bytes(self, comm, what: str, mine: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Every rank's bytes, concatenated in rank order; ``sizes`` are each rank's byte counts."""
        if len(sizes) != comm.size:
            raise ValueError(f"{what}: expected {comm.size} output tensors (one per rank), got {len(sizes)}")
        if mine.numel() != sizes[comm.rank]:
            raise ValueError(f"{what}: this rank's input has {mine.numel()} bytes, its output slot {sizes[comm.rank]}")
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        self._run(comm.allgather_into_, out, mine, list(sizes))
        return out

    @_not_compiled
    @device_routed("all_gather")
    def allgather(self, output_tensors, input_tensors, opts=None):
        comm = self._ring("all_gather")
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"all_gather: {len(output_tensors)} output lists for {len(input_tensors)} inputs")
        for outs, inp in zip(output_tensors, input_tensors):
            all_gather_list(comm, self._run, outs, inp)
        return _Done([o for outs in output_tensors for o in outs])

    @_not_compiled
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    @_not_compiled
    @device_routed("all_gather_into_tensor")
    def _allgather_base(self, output, input, opts=None):
        all_gather_into_tensor(self._ring("all_gather_into_tensor"), self._run, output, input)
        return _Done([output])

    @_not_compiled
    @device_routed("all_gather_into_tensor_coalesced")
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        comm = self._ring("all_gather_into_tensor_coalesced")
        if len(outputs) != len(inputs):
            raise ValueError(f"all_gather_into_tensor_coalesced: {len(outputs)} outputs for {len(inputs)} inputs")
        for o, i in zip(outputs, inputs):
            all_gather_into_tensor(comm, self._run, o, i, "all_gather_into_tensor_coalesced")
        return _Done(outputs)

    @_not_compiled
    @device_routed("gather")
    def gather(self, output_tensors, input_tensors, opts=None):
        what = "gather"
        comm = self._ring(what)
        root = opts.rootRank if opts is not None else 0
        inp = check_cpu(input_tensors[0], what)
        n = inp.numel() * inp.element_size()
        # Every rank passes the same shape (torch's contract), so the root's slots are known to all.
        flat = self._gather_bytes(comm, what, _bytes(inp.contiguous()), [n] * comm.size)
        if comm.rank == root:
            outs = output_tensors[0]
            if len(outs) != comm.size:
                raise ValueError(f"{what}: the root needs {comm.size} output tensors, got {len(outs)}")
            for r, o in enumerate(outs):
                c = Contiguous(o)
                _bytes(c.work).copy_(flat[r * n:(r + 1) * n])
                c.done()
        return _Done(output_tensors[0] if output_tensors else [])

    @_not_compiled
    @device_routed("scatter")
    def scatter(self, output_tensors, input_tensors, opts=None):
        what = "scatter"
        comm = self._ring(what)
        root = opts.rootRank if opts is not None else 0
        out = check_cpu(output_tensors[0], what)
        n = out.numel() * out.element_size()
        buf = torch.empty(n * comm.size, dtype=torch.uint8)
        if comm.rank == root:
            ins = input_tensors[0]
            if len(ins) != comm.size:
                raise ValueError(f"{what}: the root needs {comm.size} input tensors, got {len(ins)}")
            for r, i in enumerate(ins):
                if i.numel() * i.element_size() != n:
                    raise ValueError(f"{what}: input {r} has another size than the output")
                buf[r * n:(r + 1) * n].copy_(_bytes(i.contiguous()))
        if buf.numel():
            self._run(comm.broadcast_, buf, root)
        c = Contiguous(out)
        _bytes(c.work).copy_(buf[comm.rank * n:(comm.rank + 1) * n])
        c.done()
        return _Done([out])

    def _alltoall_bytes(self, comm, what: str, send: Sequence[torch.Tensor],
                        expect: Sequence[int]) -> List[torch.Tensor]:
        """Rank j gets ``send[j]`` of every rank: what each sends is gathered by all (the ring has
        no point-to-point; correct, at world-size times the bytes of a direct exchange, and every
        rank holds the whole exchange for a moment). ``expect[src]``: the bytes this rank's
        outputs hold for ``src``."""
        counts = torch.tensor([s.numel() for s in send], dtype=torch.int64)
        table = self._run(comm.allgather_equal, counts).tolist()
        # What the senders announce must be what this rank's outputs hold, and the whole within
        # bounds, before anything is allocated. Every rank says whether it agrees, so all of them
        # raise together instead of the others waiting in the exchange for one that gave up.
        column = [table[src][comm.rank] for src in range(comm.size)]
        total = sum(map(sum, table))
        ok = column == list(expect) and all(c >= 0 for row in table for c in row) and total <= _MAX_ALLTOALL_BYTES
        verdicts = self._run(comm.allgather_equal, torch.tensor([int(ok)], dtype=torch.int64))[:, 0]
        if not ok:
            raise ValueError(f"{what}: rank {comm.rank} expects {list(expect)} bytes from the ranks and they send "
                             f"{column} (all ranks: {total} bytes, at most {_MAX_ALLTOALL_BYTES}); every rank "
                             "must pass matching split sizes")
        refused = [r for r, v in enumerate(verdicts.tolist()) if v != 1]
        if refused:
            raise ValueError(f"{what}: rank(s) {refused} found the split sizes the ranks passed inconsistent "
                             "(their error says how)")
        mine = torch.cat([s.reshape(-1) for s in send]) if send else torch.empty(0, dtype=torch.uint8)
        flat = self._gather_bytes(comm, what, mine, [sum(row) for row in table])
        got, at = [], 0
        for src in range(comm.size):
            offset = at + sum(table[src][:comm.rank])
            got.append(flat[offset:offset + table[src][comm.rank]])
            at += sum(table[src])
        return got

    @_not_compiled
    @device_routed("all_to_all")
    def alltoall(self, output_tensors, input_tensors, opts=None):
        what = "all_to_all"
        comm = self._ring(what)
        if len(input_tensors) != comm.size or len(output_tensors) != comm.size:
            raise ValueError(f"{what}: expected {comm.size} input and output tensors (one per rank)")
        got = self._alltoall_bytes(comm, what, [_bytes(check_cpu(i, what).contiguous()) for i in input_tensors],
                                   [check_cpu(o, what).numel() * o.element_size() for o in output_tensors])
        for o, data in zip(output_tensors, got):
            c = Contiguous(o)
            _bytes(c.work).copy_(data)
            c.done()
        return _Done(output_tensors)

    @_not_compiled
    @device_routed("all_to_all_single")
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        what = "all_to_all_single"
        comm = self._ring(what)
        check_cpu(input, what)
        check_cpu(output, what)
        if input.dim() == 0:
            raise ValueError(f"{what}: the input needs at least one dimension")
        splits_in = list(input_split_sizes) or [input.shape[0] // comm.size] * comm.size
        if len(splits_in) != comm.size or sum(splits_in) != input.shape[0]:
            raise ValueError(f"{what}: input split sizes {splits_in} do not divide {input.shape[0]} rows "
                             f"among {comm.size} ranks")
        row = (input.numel() // max(input.shape[0], 1)) * input.element_size()
        data = _bytes(input.contiguous())
        send, at = [], 0
        for n in splits_in:
            send.append(data[at:at + n * row])
            at += n * row
        if output.dim() == 0 or output.dtype != input.dtype:
            raise ValueError(f"{what}: the output needs at least one dimension and the input's dtype {input.dtype}")
        splits_out = list(output_split_sizes) or [output.shape[0] // comm.size] * comm.size
        if len(splits_out) != comm.size or sum(splits_out) != output.shape[0]:
            raise ValueError(f"{what}: output split sizes {splits_out} do not divide {output.shape[0]} rows "
                             f"among {comm.size} ranks")
        out_row = (output.numel() // max(output.shape[0], 1)) * output.element_size()
        got = self._alltoall_bytes(comm, what, send, [n * out_row for n in splits_out])
        flat = torch.cat(got) if got else torch.empty(0, dtype=torch.uint8)
        c = Contiguous(output)
        _bytes(c.work).copy_(flat)
        c.done()
        return _Done([output])

    # torch 2.13's names for the single-tensor forms; older torch calls the underscored ones.
    @_not_compiled
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    @_not_compiled
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    @_not_compiled
    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    @_not_compiled
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    @_not_compiled
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    @_not_compiled
    def barrier(self, opts=None):
        comm = self._ring("barrier")
        self._run(comm.barrier)
        return _Done()

    # ------------------------------------------------------------------ what the ring has not
    def _unsupported(self, what: str):
        raise NotImplementedError(f"torch.distributed {what} is not supported on the elastic group "
                                  "(the ring has all_reduce, broadcast, all_gather, reduce_scatter, "
                                  "all_to_all, gather, scatter, reduce and barrier)")

    def send(self, *args, **kwargs):
        self._unsupported("send (point-to-point)")

    def recv(self, *args, **kwargs):
        self._unsupported("recv (point-to-point)")

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv (point-to-point)")

    def monitored_barrier(self, *args, **kwargs):
        self._unsupported("monitored_barrier")

    def split_group(self, *args, **kwargs):
        self._unsupported("split_group")

    def merge_remote_group(self, *args, **kwargs):
        self._unsupported("merge_remote_group")


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _the_group() -> ElasticProcessGroup:
    """The one group, made on first use (under ``_lock``: never two)."""
    c10d_tables.check()
    c10d_tables.register_backend()
    group = ElasticProcessGroup()
    # torch's object collectives pickle; on this group they carry elastic.ring.serialization's format.
    c10d_tables.replace_functions(objects.PUBLIC, objects.HELPERS)
    return group


def process_group() -> ElasticProcessGroup:
    """The process's elastic ``torch.distributed.ProcessGroup``: the same object across re-forms."""
    with _lock:
        pg = _the_group()
    c10d_tables.enter_group(pg, GROUP_NAME)
    return pg


def install_default_group(enabled: Optional[bool] = None) -> bool:
    """Makes the elastic group torch.distributed's default group (inside ``elastic.run``).

    Skipped when not ``enabled`` (default: ``ELASTIC_DEFAULT_GROUP``, read by
    ``elastic.runtime.worker_config``) or when the script initialized a default group itself (that
    one is left alone and does not follow re-forms; a warning says so). Returns whether the elastic
    group is the default group now. torch's tables are private: if they change shape, this logs
    why and training goes on without the default group.
    """
    if not (default_group_from_env() if enabled is None else enabled):
        return False
    if dist.is_initialized() and not c10d_tables.is_default(process_group()):
        log.warning("torch.distributed's default group was initialized by the script (backend %s): elastic.run "
                    "leaves it, and dist.* calls on it do not survive failures; pass "
                    "group=elastic.process_group(), or drop init_process_group()", dist.get_backend())
        return False
    try:
        c10d_tables.make_default(process_group(), GROUP_NAME)
    except Exception as e:  # noqa: BLE001 (torch internals; the ring itself is unaffected)
        log.warning("could not make the elastic ring torch.distributed's default group (%s: %s); dist.* calls "
                    "need group=elastic.process_group()", type(e).__name__, e)
        return False
    return True


__all__ = ["ElasticProcessGroup", "process_group", "install_default_group"]
