"""torch's gather and reduce-scatter calls mapped onto the ring's own phases.

What FSDP2 and DTensor call on a process group (``all_gather_into_tensor``,
``reduce_scatter_tensor``, their coalesced and list forms) runs here as one ring allgather
(``Communicator.allgather_into_``) or one ring reduce-scatter (``Communicator.reduce_scatter_``)
each: n-1 steps, each rank sending (n-1)/n of the data, the least any algorithm moves; nothing
is built from allreduce. Tensors are handed to the core as they are when they are contiguous
(FSDP2's are; an all-gather whose input is this rank's slot of its own output, as FSDP2's
copy-in makes it, moves nothing locally), so the only copies are the ones torch's layouts
force: a non-contiguous output is gathered beside and copied back, and a list of inputs that
do not already lie end to end in one buffer is concatenated once.

Dtypes: the ring's own (float16, bfloat16, float32, float64, int32, int64, uint8) reduce in
place; bool reduces as its uint8 bytes (SUM and BOR are MAX, BAND is MIN: gloo's answers);
complex numbers as pairs of reals (SUM and AVG only); int8, int16, uint16 and uint32 are
widened to int64 and back, wrapping as torch's integer arithmetic does. Gathers move bytes and
take any dtype. Every function raises what the ring raises (``WorkerLostError`` on a peer's
failure) through ``run``, the group's wrapper that keeps that failure for ``elastic.run``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from elastic.ring.ops import Average, Max, Min, ReduceOp, Sum

Run = Callable[..., Any]   # the group's _run: fn(*args), keeping a ring failure for elastic.run

# The ring reduces these natively; the other integer types are widened to int64 and back
# (wrapping as torch's own integer arithmetic does), complex numbers as pairs of reals.
NATIVE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8}
WIDEN = {torch.int8, torch.int16, torch.uint16, torch.uint32}


def ring_op(op: Any, dtype: torch.dtype, what: str) -> ReduceOp:
    """The ring's reduce op for a torch ``ReduceOp`` on ``dtype``; NotImplementedError names the rest."""
    kind = op
    # == and not `in`: a ReduceOp from torch's options equals its RedOpType only compared this way round.
    if dtype.is_complex and not (kind == dist.ReduceOp.SUM or kind == dist.ReduceOp.AVG):
        raise NotImplementedError(f"{what}: {getattr(kind, 'op', kind)} on {dtype} (complex numbers have no order)")
    if dtype == torch.bool and kind == dist.ReduceOp.SUM:
        return Max   # a sum of bools is their logical or (gloo's answer); uint8 would wrap at 256 ranks
    if kind == dist.ReduceOp.SUM:
        return Sum
    if kind == dist.ReduceOp.AVG:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise NotImplementedError(f"{what}: ReduceOp.AVG on {dtype} (integer average is undefined); "
                                      "use SUM and divide")
        return Average
    if kind == dist.ReduceOp.MIN:
        return Min
    if kind == dist.ReduceOp.MAX:
        return Max
    if dtype == torch.bool and kind == dist.ReduceOp.BAND:
        return Min
    if dtype == torch.bool and kind == dist.ReduceOp.BOR:
        return Max
    name = getattr(kind, "op", kind)
    raise NotImplementedError(f"{what}: {name} on {dtype} is not supported by the elastic ring "
                              "(it has SUM, AVG, MIN, MAX, and BAND/BOR on bool)")


def check_cpu(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise NotImplementedError(f"{what}: the elastic ring moves CPU tensors; got one on {t.device}")
    if t.is_sparse:
        raise NotImplementedError(f"{what}: sparse tensors are not supported by the elastic ring")
    return t


class Contiguous:
    """The contiguous tensor a collective writes, copied back into ``t`` after when it is not."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.work = t if t.is_contiguous() else t.contiguous()

    def done(self) -> None:
        if self.work is not self.t:
            with torch.no_grad():   # a view of a Parameter takes the result in place, as with gloo
                self.t.copy_(self.work)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _end_to_end(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one flat tensor that ``tensors`` (contiguous, one dtype) tile in order, when they lie
    end to end in one storage (``torch.chunk``/``split`` of a contiguous tensor); else None."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return None
    storage = first.untyped_storage().data_ptr()
    at, esize = first.data_ptr(), first.element_size()
    for t in tensors:
        if t.numel() and (t.untyped_storage().data_ptr() != storage or t.data_ptr() != at):
            return None
        at += t.numel() * esize
    total = sum(t.numel() for t in tensors)
    if (first.storage_offset() + total) * esize > first.untyped_storage().nbytes():
        return None
    return first.detach().as_strided((total,), (1,), first.storage_offset())


# ---------------------------------------------------------------------- gathers
def all_gather_into_tensor(comm, run: Run, output: torch.Tensor, input: torch.Tensor,
                           what: str = "all_gather_into_tensor") -> None:
    """``output`` gets every rank's ``input`` in rank order (equal sizes: torch's contract)."""
    check_cpu(input, what)
    check_cpu(output, what)
    if output.dtype != input.dtype or output.numel() != input.numel() * comm.size:
        raise ValueError(f"{what}: the output must hold world size {comm.size} x the input ({input.numel()} x "
                         f"{input.dtype}), got {output.numel()} x {output.dtype}; a DeviceMesh or FSDP module "
                         "made in an earlier world? Make them again in each world with elastic.device_mesh()")
    if not output.numel():
        return
    out = Contiguous(output)
    inp = input if input.is_contiguous() else input.contiguous()
    run(comm.allgather_into_, _bytes_of(out.work), _bytes_of(inp))
    out.done()


def all_gather_list(comm, run: Run, outputs: Sequence[torch.Tensor], input: torch.Tensor,
                    what: str = "all_gather") -> None:
    """``outputs[r]`` gets rank r's ``input``; sizes may differ by rank (each rank's output
    list says how many elements every rank sends)."""
    check_cpu(input, what)
    if len(outputs) != comm.size:
        raise ValueError(f"{what}: expected {comm.size} output tensors (one per rank), got {len(outputs)}")
    for o in outputs:
        check_cpu(o, what)
        if o.dtype != input.dtype:
            raise ValueError(f"{what}: output dtype {o.dtype} differs from the input's {input.dtype}")
    if outputs[comm.rank].numel() != input.numel():
        raise ValueError(f"{what}: this rank's input has {input.numel()} elements, its output slot "
                         f"{outputs[comm.rank].numel()}")
    counts = [o.numel() for o in outputs]
    if not sum(counts):
        return
    inp = input if input.is_contiguous() else input.contiguous()
    flat = _end_to_end(outputs)
    if flat is not None:   # gathered straight into the caller's tensors
        run(comm.allgather_into_, flat, _flat(inp), counts)
        return
    flat = torch.empty(sum(counts), dtype=input.dtype)
    run(comm.allgather_into_, flat, _flat(inp), counts)
    at = 0
    with torch.no_grad():
        for o, n in zip(outputs, counts):
            o.copy_(flat[at:at + n].view_as(o))
            at += n


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: gathers move bytes (any dtype, complex too)."""
    return t.detach().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------- reduce-scatters
def _as_ring(t: torch.Tensor) -> torch.Tensor:
    """How a contiguous tensor of a dtype the ring reduces travels: itself, its bytes (bool),
    or its real pairs (complex); None for the dtypes that must be widened."""
    if t.dtype in NATIVE:
        return _flat(t)
    if t.dtype == torch.bool:
        return _flat(t).view(torch.uint8)
    if t.dtype.is_complex:
        return _flat(torch.view_as_real(t.detach()))
    return None


def _reduce_scatter_flat(comm, run: Run, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                         counts: List[int], what: str) -> None:
    """The ring reduce-scatter of contiguous ``input`` (blocks of ``counts`` elements) into
    contiguous ``output``, in whichever representation its dtype travels."""
    out, inp = _as_ring(output), _as_ring(input)
    if out is not None:
        if input.dtype.is_complex:
            counts = [2 * c for c in counts]
        run(comm.reduce_scatter_, out, inp, op, counts)
    elif input.dtype in WIDEN:
        wide = torch.empty(output.numel(), dtype=torch.int64)
        run(comm.reduce_scatter_, wide, _flat(input).to(torch.int64), op, counts)
        _flat(output).copy_(wide)
    else:
        raise NotImplementedError(f"{what}: dtype {input.dtype} is not supported by the elastic ring")


def reduce_scatter_tensor(comm, run: Run, output: torch.Tensor, input: torch.Tensor, torch_op: Any,
                          what: str = "reduce_scatter_tensor") -> None:
    """``output`` gets this rank's block of ``input`` (world size equal blocks) reduced over every rank."""
    check_cpu(input, what)
    check_cpu(output, what)
    if input.dtype != output.dtype or input.numel() != output.numel() * comm.size:
        raise ValueError(f"{what}: the input has {input.numel()} x {input.dtype}, expected the output's "
                         f"{output.numel()} x {output.dtype} times world size {comm.size}; a DeviceMesh or FSDP "
                         "module made in an earlier world? Make them again in each world with elastic.device_mesh()")
    op = ring_op(torch_op, input.dtype, what)
    if not output.numel():
        return
    out = Contiguous(output)
    inp = input if input.is_contiguous() else input.contiguous()
    _reduce_scatter_flat(comm, run, out.work, inp, op, [output.numel()] * comm.size, what)
    out.done()


def reduce_scatter_list(comm, run: Run, output: torch.Tensor, inputs: Sequence[torch.Tensor], torch_op: Any,
                        what: str = "reduce_scatter") -> None:
    """``output`` gets ``inputs[rank]`` reduced over every rank; ``inputs[r]`` is rank r's block,
    so blocks may differ in size (every rank passes the same sizes)."""
    check_cpu(output, what)
    if len(inputs) != comm.size:
        raise ValueError(f"{what}: expected {comm.size} input tensors (one per rank), got {len(inputs)}")
    for i in inputs:
        check_cpu(i, what)
        if i.dtype != output.dtype:
            raise ValueError(f"{what}: input dtype {i.dtype} differs from the output's {output.dtype}")
    if inputs[comm.rank].numel() != output.numel():
        raise ValueError(f"{what}: this rank's block of the input has {inputs[comm.rank].numel()} elements, its "
                         f"output {output.numel()}")
    op = ring_op(torch_op, output.dtype, what)
    counts = [i.numel() for i in inputs]
    if not sum(counts):
        return
    flat = _end_to_end(inputs)
    if flat is None:
        flat = torch.cat([_flat(i) for i in inputs])
    out = Contiguous(output)
    _reduce_scatter_flat(comm, run, out.work, flat, op, counts, what)
    out.done()


__all__ = ["NATIVE", "WIDEN", "Contiguous", "check_cpu", "ring_op", "all_gather_into_tensor", "all_gather_list", "reduce_scatter_tensor", "reduce_scatter_list"]
