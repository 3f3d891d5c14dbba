"""A ring communicator for one world version: form it, run collectives, abort it, discard it.

The runtime forms one per world version from the membership the rendezvous announces;
tests and tools can form one from an explicit peer list::

    listener = elastic.Listener("127.0.0.1")          # before rendezvous: announce .address
    comm = elastic.Communicator.form(listener=listener, job_id="job", secret=b"s3cret",
                                     world_version=1, rank=r, peers=addresses)
    comm.allreduce_(tensor, elastic.Average)

After any ``WorkerLostError`` the communicator is poisoned: close it and form a new one.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple

import numpy as np

from rendezvous.wire.membership import Blame

from elastic.ring import _native, buffers, serialization
from elastic.ring.arrival import Arrival
from elastic.ring.comm_config import CommConfig
from elastic.ring.errors import BadPeerError, ElasticError, ErrorKind, RingFailure, SettingsMismatchError, from_native
from elastic.ring.majority import odd_ranks
from elastic.ring.ops import ReduceOp
from elastic.ring.ring_view import RingView, list_digest
from elastic.ring.wait_clock import WaitClock

Listener = _native.Listener
ErrorKind = _native.ErrorKind

_MAX_ALLGATHER_NDIM = 12
# What one allgather may gather in all (every rank holds the whole result), and what one rank's
# object may take in an object collective; both bound what a peer's announced size makes this
# rank allocate. Sizes beyond them can only come from a peer that does not follow the protocol.
MAX_ALLGATHER_BYTES = 1 << 36
MAX_OBJECT_BYTES = 1 << 30
# What a rank announces instead of a size when it cannot send its object (all ranks raise).
CANNOT_CARRY, TOO_LARGE = -1, -2


class RingObserver(Protocol):
    """Who counts a ring's allreduces (a worker's metrics): told of each one as it runs."""

    def allreduce_done(self, comm: "Communicator", t: Any, started: float) -> None: ...
    def allreduce_started(self, comm: "Communicator", t: Any) -> None: ...
    def allreduce_waited(self, comm: "Communicator", t: Any, started: float) -> None: ...


def _translated(method: Callable) -> Callable:
    """A method that calls the core: a ``RingFailure`` it raises becomes the elastic exception
    of its kind (``elastic.ring.errors.from_native``)."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RingFailure as failure:
            raise from_native(failure) from None
    return call


def _blocking(method: Callable) -> Callable:
    """A blocking collective: translated, and the time each call takes is a span of the
    communicator's ``wait_clock`` (straggler detection's waiting time)."""
    @functools.wraps(method)
    def call(self: "Communicator", *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            if self.arrival is not None:   # a ring kept after the run (elastic.ring.arrival)
                return self.arrival.run(self, self._native, method.__name__,
                                        lambda: method(self, *args, **kwargs), RingFailure)
            return method(self, *args, **kwargs)
        except RingFailure as failure:
            raise from_native(failure) from None
        finally:
            self.wait_clock.waited(started)
    return call


class Handle:
    """An in-flight async allreduce; pass it to ``synchronize``."""

    __slots__ = ("_comm", "_work", "tensor", "submitted")

    def __init__(self, comm: "Communicator", work: Any, tensor: Any, submitted: float):
        self._comm = comm
        self._work = work
        self.tensor = tensor  # keeps the buffer alive until the collective is done
        self.submitted = submitted   # perf_counter() at submission: waiting counts from there

    def done(self) -> bool:
        return self._work.done()


class Communicator:
    """A formed ring. Collectives are blocking unless named ``*_async_``; all release the GIL.

    The time a caller spends blocked in one is a span of ``wait_clock``, what straggler
    detection counts as waiting (``elastic.runtime.straggler_detector``): it covers every path to
    the ring, DDP's comm hook too. ``observer`` (a worker's metrics) is told of every allreduce."""

    def __init__(self, native: Any, config: CommConfig, *, wait_clock: Optional[WaitClock] = None,
                 observer: Optional[RingObserver] = None):
        self._native = native
        self.config = config
        self.wait_clock = wait_clock if wait_clock is not None else WaitClock()
        self.observer = observer
        self.arrival: Optional[Arrival] = None   # set on a ring kept after the run: every member must enter
        # Who this ring is stays readable after close() (a failed connect() closes it while
        # the event thread may still compare versions with it).
        self._rank, self._size, self._world_version = native.rank, native.size, native.world_version
        # Async handles not yet synchronized: the core holds raw pointers into their tensors,
        # so the tensors must live until the work is done even if the caller drops the handle.
        self._inflight: dict = {}
        self._flushed_at = 0.0   # perf_counter() of the last flush(): async allreduces submitted before it run

    @classmethod
    def create(cls, *, listener: Optional[Listener], job_id: str, secret: bytes, world_version: int, rank: int,
               peers: Optional[Sequence[str]] = None, config: Optional[CommConfig] = None,
               hosts: Optional[Sequence[str]] = None, wait_clock: Optional[WaitClock] = None,
               observer: Optional[RingObserver] = None, view: Optional[RingView] = None) -> "Communicator":
        """Validates the arguments and returns an unconnected communicator; ``connect()`` forms it.

        The world is given either in full, ``peers`` (every rank's ring address in rank order),
        or as this rank's ``view`` (``elastic.ring.ring_view.RingView``: only the ranks its rings
        connect to, its host's layout and the world's digest), which is what a worker gets from
        the rendezvous. ``hosts`` names each rank's host (in rank order) with ``peers``; a view
        carries its own. Ring neighbours with the same host name exchange data through shared
        memory (unless ``config.transport == "tcp"``); the TCP connection between them stays
        up as the liveness channel. No host names: all TCP.

        Splitting the two lets another thread hold the communicator, and abort it, while
        ``connect()`` is still waiting for a neighbour.
        """
        config = config or CommConfig.from_env()
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"job_id must be a non-empty string, got {job_id!r}")
        if world_version < 0:
            raise ValueError(f"world_version must not be negative, got {world_version}")
        if (peers is None) == (view is None):
            raise ValueError("give the world either as peers (every rank's address) or as a view, not both")
        if view is not None:
            return cls._from_view(listener, job_id, secret, world_version, rank, view, config, wait_clock, observer)
        peers = list(peers)
        host_list: list = []
        if hosts is not None:
            host_list = [str(h) for h in hosts]
            if len(host_list) != len(peers):
                raise ValueError(f"hosts: got {len(host_list)} host names for {len(peers)} peers; "
                                 "give one host name per rank")
            if not all(host_list):
                raise ValueError("hosts: host names must not be empty")
        try:
            native = _native.Communicator(listener, job_id, secret, world_version, rank, peers, config.to_native(),
                                          host_list, list_digest(peers, host_list or None))
        except RingFailure as failure:
            raise from_native(failure) from None
        return cls(native, config, wait_clock=wait_clock, observer=observer)

    @classmethod
    def _from_view(cls, listener: Optional[Listener], job_id: str, secret: bytes, world_version: int, rank: int,
                   view: RingView, config: CommConfig, wait_clock: Optional[WaitClock],
                   observer: Optional[RingObserver]) -> "Communicator":
        if view.rank != rank:
            raise ValueError(f"view: it is rank {view.rank}'s, not rank {rank}'s")
        problem = view.problem()
        if problem is not None:
            raise ValueError(f"view of world version {world_version}: {problem}")
        ranks = sorted(view.peers)
        hosts = [view.peers[r][1] for r in ranks]
        if not all(hosts):
            hosts = []
        layout = view.layout.numbers() if view.layout is not None and hosts else []
        try:
            native = _native.Communicator.from_view(listener, job_id, secret, world_version, rank, view.size, ranks,
                                                    [view.peers[r][0] for r in ranks], hosts, layout,
                                                    config.to_native(), bytes(view.digest))
        except RingFailure as failure:
            raise from_native(failure) from None
        return cls(native, config, wait_clock=wait_clock, observer=observer)

    @_translated
    def connect(self) -> "Communicator":
        """Connects to the next rank and accepts the previous one (blocking, GIL released).

        On failure the communicator is closed and the error raised: ``BadPeerError`` (a
        ``WorkerLostError``) when a neighbour's announced address is unusable or what answers
        there does not prove the job's secret, naming it in ``peer_rank``; ``HandshakeError``
        when a neighbour that proved the secret refuses (another world version);
        ``SettingsMismatchError`` when the ranks' ring settings differ; ``WorkerLostError`` on
        a lost neighbour, timeout or abort.
        """
        try:
            self._native.form()
            if self.size > 1:
                self._check_same_settings()
        except BaseException:
            self._native.close()
            raise
        return self

    # Settings every rank must share: with different ones, ranks run different protocols
    # (small path or ring, flat or hierarchical, other segments or buckets) and wait on each
    # other until the collective timeout, blaming a live neighbour.
    _SHARED = ("algorithm", "hierarchical_bytes", "small_bytes", "segment_bytes", "fusion_bytes", "transport")

    def _check_same_settings(self) -> None:
        """One 48-byte allgather at form: a rank configured differently fails the form at once
        with an error naming the setting, instead of a timeout later. In a world of three or
        more the majority's settings win (``elastic.ring.majority``): the ranks that differ end
        with ``SettingsMismatchError``, the others raise ``BadPeerError`` naming the first of them
        (blame ``DIVERGED``: reported, evicted by the majority's reports) and go on without it.
        Without a majority every rank ends with ``SettingsMismatchError``."""
        words = ("auto", "ring", "hierarchical", "tcp")  # the string settings, as numbers
        mine = np.array([v if isinstance(v, int) else words.index(v)
                         for v in (getattr(self.config, n) for n in self._SHARED)], dtype=np.int64)
        every = np.empty(len(mine) * self.size, dtype=np.int64)
        self._native.allgather_(mine, every, [mine.nbytes] * self.size)
        every = every.reshape(self.size, len(mine))
        odd = odd_ranks([tuple(r) for r in every.tolist()])
        if odd == ():
            return
        differs = []
        for i, name in enumerate(self._SHARED):
            column = every[:, i].tolist()
            if len(set(column)) == 1:
                continue
            by_value: dict = {}
            for r, v in enumerate(column):
                if isinstance(getattr(self.config, name), str):   # a peer's number: an index only once checked
                    v = words[v] if 0 <= v < len(words) else f"unknown value {v}"
                by_value.setdefault(v, []).append(r)
            said = "; ".join(f"{v} on rank(s) {','.join(map(str, rs))}" for v, rs in by_value.items())
            differs.append((name, f"ring setting {name} ({CommConfig.env_var(name)}) differs between the ranks of "
                                  f"world version {self.world_version}: {said}"))
        name, said = differs[0]
        if odd is None or self.rank in odd:
            why = ("; every worker must use the same" if odd is None else
                   "; this rank differs from the majority of the world and leaves it; every worker must use the same")
            raise SettingsMismatchError(said + why, world_version=self.world_version, rank=self.rank, setting=name,
                                        outvoted=odd is not None)
        raise BadPeerError(f"{said}; rank {odd[0]} differs from the majority of the world"
                           + (f" (so do rank(s) {', '.join(map(str, odd[1:]))})" if len(odd) > 1 else ""),
                           op="form", world_version=self.world_version, rank=self.rank, peer=odd[0],
                           kind=ErrorKind.BadPeer, blame=Blame.DIVERGED)

    @classmethod
    def form(cls, *, listener: Optional[Listener], job_id: str, secret: bytes, world_version: int, rank: int,
             peers: Optional[Sequence[str]] = None, config: Optional[CommConfig] = None,
             hosts: Optional[Sequence[str]] = None, wait_clock: Optional[WaitClock] = None,
             view: Optional[RingView] = None) -> "Communicator":
        """Creates and connects a ring in one call.

        ``peers`` lists every rank's ring address in rank order (``peers[rank]`` is this
        worker's own); ``hosts``, if given, each rank's host name; or ``view`` instead of both
        (see ``create``). A world of one rank needs no listener and opens no socket.
        """
        return cls.create(listener=listener, job_id=job_id, secret=secret, world_version=world_version,
                          rank=rank, peers=peers, config=config, hosts=hosts, wait_clock=wait_clock,
                          view=view).connect()

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def world_version(self) -> int:
        return self._world_version

    @property
    def ops_run(self) -> int:
        """Collectives started on this ring so far; a fused bucket counts once."""
        return self._native.ops_run

    @property
    def link_kinds(self) -> tuple:
        """How this rank's links run: (to the next rank, from the previous one), each "tcp" or "shm"."""
        return tuple(self._native.link_kinds)

    @property
    def hierarchy(self) -> dict:
        """Where this rank sits for the hierarchical allreduce: ``applies`` (and ``why_not`` when it
        does not), ``num_hosts``, ``host``, ``local_rank``, ``local_size``, ``leader``, ``leaders``."""
        return dict(self._native.hierarchy)

    @property
    def hierarchical_link_kinds(self) -> tuple:
        """How the hierarchical path's rings run: ((local send, recv), (leaders send, recv)),
        each pair empty when this rank is in no such ring."""
        return tuple(tuple(k) for k in self._native.hierarchical_link_kinds)

    def algorithm_for(self, nbytes: int) -> str:
        """What ``allreduce_`` runs for a buffer of ``nbytes`` bytes: "ring" or "hierarchical"."""
        return self._native.algorithm_for(int(nbytes))

    @property
    def failed(self) -> bool:
        """True once an operation failed or the ring was aborted or closed."""
        try:
            return self._native.failed
        except (ValueError, RuntimeError):  # closed
            return True

    # ------------------------------------------------------------------ lifecycle
    @_translated
    def abort(self, reason: str = "") -> None:
        """Fails in-flight and later operations within milliseconds; safe from any thread."""
        self._native.abort(reason)

    @_translated
    def close(self) -> None:
        """Aborts anything in flight, stops the executor thread and closes the sockets."""
        self._native.close()  # returns after the executor thread has finished every queued op
        self._inflight.clear()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ collectives
    @_blocking
    def allreduce_(self, t: Any, op: ReduceOp = ReduceOp.Average) -> Any:
        started = time.perf_counter()
        self._native.allreduce_(buffers.native_array(t, "allreduce_"), int(ReduceOp(op)))
        if self.observer is not None:
            self.observer.allreduce_done(self, t, started)
        return t

    def allreduce(self, t: Any, op: ReduceOp = ReduceOp.Average) -> Any:
        torch = buffers.torch_module()
        out = t.copy() if isinstance(t, np.ndarray) else t.detach().clone(memory_format=torch.contiguous_format)
        return self.allreduce_(out, op)

    @_translated
    def allreduce_async_(self, t: Any, op: ReduceOp = ReduceOp.Average) -> Handle:
        submitted = time.perf_counter()
        work = self._native.allreduce_async_(buffers.native_array(t, "allreduce_async_"), int(ReduceOp(op)))
        handle = Handle(self, work, t, submitted)
        if self.observer is not None:
            self.observer.allreduce_started(self, t)
        if len(self._inflight) >= 4096:
            self._inflight = {k: h for k, h in self._inflight.items() if not h.done()}
        self._inflight[id(handle)] = handle
        return handle

    @_translated
    def synchronize(self, handle: Handle) -> Any:
        if handle._comm is not self:
            raise ValueError("synchronize: the handle belongs to another communicator")
        started = time.perf_counter()
        # Waiting on it (elastic.runtime.straggler_detector) counts from its submission when a flush() sent it on
        # its way then (DDP's hook flushes each bucket), else from now (it runs now); not at all
        # when it finished already while this rank computed.
        waiting = not handle._work.done()
        since = handle.submitted if self._flushed_at >= handle.submitted else started
        try:
            self._native.wait(handle._work)
            if self.observer is not None:
                self.observer.allreduce_waited(self, handle.tensor, started)
        finally:
            self._inflight.pop(id(handle), None)
            if waiting:
                self.wait_clock.waited(since)
        return handle.tensor

    @_translated
    def flush(self) -> None:
        """Starts any open fusion bucket now instead of at the next synchronize."""
        self._native.flush()
        self._flushed_at = time.perf_counter()

    @_blocking
    def broadcast_(self, t: Any, root_rank: int = 0) -> Any:
        self._native.broadcast_(buffers.native_array(t, "broadcast_"), root_rank)
        return t

    @_blocking
    def barrier(self) -> None:
        self._native.barrier()

    @_blocking
    def allgather_into_(self, output: Any, input: Any, counts: Optional[Sequence[int]] = None) -> Any:
        """Ring allgather into ``output``: every rank's ``input``, flattened, in rank order.

        ``counts`` gives each rank's number of elements (default: ``output`` holds ``size``
        equal blocks). ``input`` and ``output`` are contiguous, of one dtype (any dtype: the
        bytes are moved, never read). Returns ``output``."""
        out = buffers.native_array(output, "allgather_into_")
        inp = buffers.native_array(input, "allgather_into_", read_only=True)
        esize = buffers.itemsize(out)
        if buffers.itemsize(inp) != esize or str(inp.dtype) != str(out.dtype):
            raise ValueError(f"allgather_into_: input dtype {inp.dtype} differs from the output's {out.dtype}")
        counts = self._counts("allgather_into_", counts, buffers.numel(out))
        if buffers.numel(inp) != counts[self.rank]:
            raise ValueError(f"allgather_into_: rank {self.rank}'s input has {buffers.numel(inp)} elements, its block "
                             f"{counts[self.rank]}")
        self._native.allgather_(buffers.as_bytes(inp), buffers.as_bytes(out), [c * esize for c in counts])
        return output

    @_blocking
    def reduce_scatter_(self, output: Any, input: Any, op: ReduceOp = ReduceOp.Sum,
                        counts: Optional[Sequence[int]] = None) -> Any:
        """Ring reduce-scatter: ``input`` holds one block per rank in rank order (``counts``
        elements each; default ``size`` equal blocks); ``output`` gets this rank's block reduced
        over every rank. Each rank sends (size-1)/size of ``input``, the least any algorithm can.
        ``input`` is not changed. Returns ``output``."""
        out = buffers.native_array(output, "reduce_scatter_")
        inp = buffers.native_array(input, "reduce_scatter_", read_only=True)
        if str(inp.dtype) != str(out.dtype):
            raise ValueError(f"reduce_scatter_: input dtype {inp.dtype} differs from the output's {out.dtype}")
        counts = self._counts("reduce_scatter_", counts, buffers.numel(inp))
        if buffers.numel(out) != counts[self.rank]:
            raise ValueError(f"reduce_scatter_: rank {self.rank}'s output has {buffers.numel(out)} elements, its block "
                             f"{counts[self.rank]}")
        self._native.reduce_scatter_(inp, out, counts, int(ReduceOp(op)))
        return output

    @_blocking
    def shift(self, input: Any, max_bytes: Optional[int] = None, *, backward: bool = False) -> Any:
        """One step round the ring: sends ``input``'s bytes to the next rank (``rank + 1``,
        wrapping) and returns the previous rank's (a flat uint8 tensor, or array for a numpy
        input); ``backward=True``: to ``rank - 1``, from ``rank + 1`` (see ``shift_into_``).
        Sizes may differ by rank: each sender announces its size first, so a receiver allocates
        exactly that, never more than ``max_bytes``. A sender announcing more (or a negative
        size) is that peer's failure: the ring is aborted, so no rank waits on it, and this rank
        raises ``BadPeerError`` naming it. Any dtype: bytes are moved, never read."""
        inp = buffers.as_bytes(buffers.native_array(input, "shift", read_only=True))
        mine = np.array([buffers.numel(inp)], dtype=np.int64)
        theirs = np.empty(1, dtype=np.int64)
        self._native.shift_(mine, theirs, backward)
        n = int(theirs[0])
        sender = (self.rank + (1 if backward else -1)) % self.size
        if n < 0 or (max_bytes is not None and n > max_bytes):
            why = f"rank {sender} announced {n} bytes for a shift, more than the {max_bytes} this rank takes"
            self.abort(why)
            raise self._blame(why, "shift", sender)
        torch = buffers.torch_module()
        out = np.empty(n, dtype=np.uint8) if isinstance(inp, np.ndarray) else torch.empty(n, dtype=torch.uint8)
        self._native.shift_(inp, out, backward)
        return out

    @_blocking
    def shift_into_(self, input: Any, output: Any, *, backward: bool = False) -> Any:
        """``shift`` with sizes both sides know: sends ``input``'s bytes to the next rank and
        receives the previous rank's into ``output`` (``backward=True``: to ``rank - 1``, from
        ``rank + 1``; in a world of three or more the first one forms the reverse ring, one more
        connection to each neighbour). An ``output`` of another size than its sender sends fails
        the receiver at the first segment (``CollectiveMismatchError`` naming the sender), and
        its neighbours at once after. Any dtypes; the two must not overlap. Returns ``output``."""
        self._native.shift_(buffers.as_bytes(buffers.native_array(input, "shift_into_", read_only=True)),
                            buffers.as_bytes(buffers.native_array(output, "shift_into_")), backward)
        return output

    def _counts(self, what: str, counts: Optional[Sequence[int]], total: int) -> list:
        """Per-rank element counts: given (each a non-negative int, summing to ``total``) or
        ``size`` equal blocks of ``total``."""
        if counts is None:
            if total % self.size:
                raise ValueError(f"{what}: {total} elements do not split into {self.size} equal blocks; pass counts")
            return [total // self.size] * self.size
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts) or sum(counts) != total:
            raise ValueError(f"{what}: counts {counts[:8]}{'…' if len(counts) > 8 else ''} must be {self.size} "
                             f"non-negative numbers summing to {total}")
        return counts

    @_blocking
    def allgather_equal(self, t: Any) -> Any:
        """Every rank's ``t`` stacked along a new first dimension. ``t`` has the same shape and
        dtype on every rank, so no size is taken from a peer: how the runtime exchanges its own
        small records (commit steps, verdicts, object sizes)."""
        arr = buffers.native_array(t, "allgather_equal", read_only=True)
        shape = (self.size,) + tuple(arr.shape)
        out = np.empty(shape, dtype=arr.dtype) if isinstance(arr, np.ndarray) else buffers.torch_module().empty(shape,
                                                                                                  dtype=arr.dtype)
        nbytes = arr.nbytes if isinstance(arr, np.ndarray) else arr.numel() * arr.element_size()
        self._native.allgather_(arr, out, [nbytes] * self.size)
        return out

    def _blame(self, message: str, op: str, peer: int) -> BadPeerError:
        """What rank ``peer`` sent cannot be received: its failure (see ``BadPeerError``)."""
        return BadPeerError(f"{op} in world version {self.world_version}: {message}", op=op,
                            world_version=self.world_version, rank=self.rank, peer=peer, kind=ErrorKind.BadPeer)

    @_blocking
    def allgather(self, t: Any) -> Any:
        """Concatenates every rank's ``t`` along dimension 0 (its length may differ per rank).

        The rows each rank announces are checked before anything is allocated: a negative count,
        or counts that would take more than ``MAX_ALLGATHER_BYTES`` in all, raise
        ``BadPeerError`` naming the rank (on that rank itself, ``ValueError``)."""
        is_np = isinstance(t, np.ndarray)
        arr = buffers.native_array(t, "allgather", read_only=True)
        shape = tuple(arr.shape)
        if len(shape) == 0:
            raise ValueError("allgather: tensor needs at least one dimension")
        if len(shape) > _MAX_ALLGATHER_NDIM + 1:
            raise ValueError(f"allgather: at most {_MAX_ALLGATHER_NDIM + 1} dimensions are supported")
        dtype_name = str(arr.dtype)
        meta = np.full(16, -1, dtype=np.int64)
        meta[0] = shape[0]
        meta[1] = len(shape)
        meta[2] = _dtype_id(dtype_name)
        meta[3:3 + len(shape) - 1] = shape[1:]
        metas = np.empty(16 * self.size, dtype=np.int64)
        self._native.allgather_(meta, metas, [meta.nbytes] * self.size)
        metas = metas.reshape(self.size, 16)
        for r in range(self.size):
            if not np.array_equal(metas[r, 1:], meta[1:]):
                raise ValueError(f"allgather: rank {r} passed a tensor of another dtype or trailing shape "
                                 f"than rank {self.rank} ({dtype_name}, {shape})")
        itemsize = arr.itemsize if is_np else arr.element_size()
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
        counts = [int(metas[r, 0]) for r in range(self.size)]
        problem = allgather_counts_problem(counts, row_bytes, MAX_ALLGATHER_BYTES)
        if problem is not None:
            blamed, why = problem
            if blamed == self.rank:
                raise ValueError(f"allgather in world version {self.world_version}: this rank's {why}")
            raise self._blame(f"rank {blamed} {why}", "allgather", blamed)
        out_shape = (sum(counts),) + shape[1:]
        if is_np:
            out = np.empty(out_shape, dtype=arr.dtype)
        else:
            out = buffers.torch_module().empty(out_shape, dtype=arr.dtype)
        self._native.allgather_(arr, out, [c * row_bytes for c in counts])
        return out

    def broadcast_object(self, obj: Any = None, root_rank: int = 0, *, op: str = "broadcast_object") -> Any:
        """Returns ``root_rank``'s ``obj`` on every rank (the root gets ``obj`` itself); ``op``
        names the operation in errors.

        ``obj`` travels in ``elastic.ring.serialization``'s format, never pickle, so receiving it runs
        no code. It may be built from None, bool, int, float, complex, str, bytes, list, tuple,
        dict and OrderedDict (keys None, bool, int, float, complex, str or bytes), torch.Tensor,
        numpy.ndarray (bool/int/uint/float/complex dtypes), numpy scalars, torch.Size and
        torch.dtype, nested at most ``serialization.MAX_DEPTH`` deep, at most
        ``MAX_OBJECT_BYTES`` (1 GiB) encoded; tensors arrive as CPU tensors that own their
        memory, with ``requires_grad`` False. Anything else (a class instance, a function, a
        set) raises ``TypeError`` naming its type and where it is, on the root and, without it,
        on every other rank (an object too large: ``ValueError``). What the root sends that
        cannot be received (a size out of bounds, bytes that do not decode) raises
        ``BadPeerError`` naming the root on the others, before anything is allocated.
        """
        root_rank = int(root_rank)
        encoded, failure, size = encode_object(obj) if self.rank == root_rank else (None, None, 0)

        def check(announced: int) -> None:
            if failure is not None:   # raised after the size went out: no rank waits for an object not coming
                raise failure
            self.raise_for_object_size(announced, root_rank, op)

        buf = self.broadcast_encoded(encoded, root_rank, check, announced=size)
        if self.rank == root_rank:
            return obj
        return self.decode_object(buf, root_rank, op)

    def broadcast_encoded(self, encoded: Any, root_rank: int, check: Callable[[int], None],
                          announced: Optional[int] = None) -> np.ndarray:
        """``root_rank``'s encoded bytes (``serialization.Encoded``) on every rank, size first: the
        root announces ``announced`` (default ``encoded.nbytes``; a negative number says it has
        nothing to send), every rank passes the size to ``check``, which raises to stop before
        anything is allocated (every rank must stop alike: with a verdict from the size alone,
        or after agreeing in collectives of its own), then the bytes follow. Returns them as a
        uint8 array (the root's own too, so every rank can decode the same bytes)."""
        length = np.zeros(1, dtype=np.int64)
        if self.rank == root_rank:
            length[0] = encoded.nbytes if announced is None else announced
        self.broadcast_(length, root_rank)
        size = int(length[0])
        check(size)
        buf = np.empty(size, dtype=np.uint8)
        if self.rank == root_rank:
            encoded.copy_into(buf)
        self.broadcast_(buf, root_rank)
        return buf

    @_blocking
    def allgather_encoded(self, encoded: Any, announced: int, check: Callable[[int, int], None]) -> list:
        """Every rank's encoded bytes, in rank order, sizes first: each rank announces
        ``announced`` (its ``encoded.nbytes``, or a negative number when it has nothing to send),
        ``check(rank, size)`` runs for every rank in rank order on every rank (it raises to stop
        before anything is allocated: the same sizes, so the same verdict everywhere), then the
        bytes. Returns one uint8 array per rank."""
        sizes = [int(n) for n in self.allgather_equal(np.array([announced], dtype=np.int64))[:, 0]]
        for r, n in enumerate(sizes):
            check(r, n)
        mine = np.empty(announced, dtype=np.uint8)
        encoded.copy_into(mine)
        data = np.empty(sum(sizes), dtype=np.uint8)
        self._native.allgather_(mine, data, sizes)
        out, at = [], 0
        for n in sizes:
            out.append(data[at:at + n])
            at += n
        return out

    def raise_for_object_size(self, size: int, sender: int, op: str) -> None:
        """Raises unless ``size``, what rank ``sender`` announced for its object, may be received."""
        if size == CANNOT_CARRY:
            raise TypeError(f"{op} in world version {self.world_version}: rank {sender}'s object cannot be carried "
                            "(its own TypeError names the type)")
        if size == TOO_LARGE:
            raise ValueError(f"{op} in world version {self.world_version}: rank {sender}'s object is larger than "
                             f"{MAX_OBJECT_BYTES} bytes encoded (its own error says how large)")
        if not 0 <= size <= MAX_OBJECT_BYTES:
            raise self._blame(f"rank {sender} announced an object of {size} bytes (at most {MAX_OBJECT_BYTES})",
                              op, sender)

    def decode_object(self, data: Any, sender: int, op: str) -> Any:
        """The object in ``data``, which rank ``sender`` sent; ``BadPeerError`` naming it if none."""
        
        try:
            return serialization.loads(data)
        except ValueError as e:
            raise self._blame(f"the object rank {sender} sent is malformed: {e}", op, sender) from None


def allgather_counts_problem(counts: Sequence[int], row_bytes: int, limit: int) -> Optional[Tuple[int, str]]:
    """(rank, why) when the row counts the ranks announced for an allgather cannot be received:
    the first negative count, or, when they would take more than ``limit`` bytes in all, the
    rank announcing the most (its rows alone may fit: the gather as a whole does not)."""
    for r, c in enumerate(counts):
        if c < 0:
            return r, f"announced {c} rows"
    total = sum(c * row_bytes for c in counts)
    if total <= limit:
        return None
    r = max(range(len(counts)), key=lambda i: (counts[i], -i))
    return r, (f"announced {counts[r]} rows of {row_bytes} bytes; the gather would take {total} bytes, more than "
               f"{limit}")


def encode_object(obj: Any) -> Tuple[Any, Optional[Exception], int]:
    """(encoded, None, its size) of an object to send, or (None, the error, the sentinel to
    announce instead of a size: ``CANNOT_CARRY`` or ``TOO_LARGE``)."""
    
    try:
        encoded = serialization.encode(obj)
    except TypeError as e:
        return None, e, CANNOT_CARRY
    if encoded.nbytes > MAX_OBJECT_BYTES:
        return None, ValueError(f"the object is {encoded.nbytes} bytes encoded, more than an object collective "
                                f"carries ({MAX_OBJECT_BYTES}: elastic.ring.communicator.MAX_OBJECT_BYTES); send large "
                                "tensors with the tensor collectives"), TOO_LARGE
    return encoded, None, encoded.nbytes


_DTYPE_IDS = {name: i for i, name in enumerate(
    ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8",
     "torch.float16", "torch.bfloat16", "torch.float32", "torch.float64", "torch.int32", "torch.int64",
     "torch.uint8"])}


def _dtype_id(name: str) -> int:
    # torch and numpy spell dtypes differently; compare on the bare name.
    bare = name.replace("torch.", "")
    if bare not in _DTYPE_IDS:
        raise TypeError(f"unsupported dtype {name}; supported: float16, bfloat16, float32, float64, "
                        "int32, int64, uint8")
    return _DTYPE_IDS[bare]


__all__ = ["CommConfig", "Communicator", "ErrorKind", "Handle", "Listener", "ElasticError"]
