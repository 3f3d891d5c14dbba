"""A binary format for training state that cannot run code: what ``State.sync()`` sends between
ranks, what durable commits store, and what ``broadcast_object`` carries.

pickle (and ``torch.load(weights_only=False)``) calls whatever the bytes name, so whoever can
send a sync payload or plant a checkpoint file runs code in every worker. This format holds
data only: every value is one tag byte from a fixed table and its contents; the decoder builds
values of the types below and nothing else (no names are looked up, nothing is called that the
data chooses), so reading hostile bytes yields either these values or a ``ValueError`` naming
the offset and what was wrong there.

What it carries, exactly (anything else is refused with ``TypeError`` naming it and where it is):

| value | arrives as |
| --- | --- |
| ``None``, ``bool``, ``int`` (any size), ``float``, ``complex``, ``str``, ``bytes`` | the same, bit-exact (NaN payloads, -0.0 included); subclasses (an ``IntEnum``, a ``numpy.float64``) are not these types: numpy scalars are carried as numpy scalars, the rest is refused |
| ``list``, ``tuple`` | ``list``, ``tuple`` |
| ``dict`` | ``dict``, insertion order kept; keys are ``None``, ``bool``, 64-bit ``int``, ``str`` or ``bytes`` (what ``state_dict()`` uses; floats and big ints hash to chosen collisions, which would make decoding quadratic) |
| ``collections.OrderedDict`` | ``OrderedDict`` with the same ``_metadata`` (what ``Module.state_dict()`` attaches); no other attribute |
| ``torch.Tensor``, ``torch.nn.Parameter`` | a new contiguous CPU ``torch.Tensor`` that owns its memory: same dtype, shape and bits; ``requires_grad`` False (what ``state_dict()`` gives); any device is read through host memory; sparse, quantized, nested, meta tensors and other subclasses are refused |
| ``numpy.ndarray`` (bool, int, uint, float, complex dtypes) | a new C-contiguous ``ndarray`` that owns its memory, same shape and values, little-endian dtype; subclasses (``np.matrix``, masked arrays, memmaps) are refused |
| numpy scalars of those dtypes | the same numpy scalar type |
| ``torch.Size``, ``torch.dtype`` | the same |

Limits, the same when encoding and decoding (so what ``commit()`` accepts a peer can read):
``MAX_DEPTH`` nesting levels, ``MAX_ITEMS`` values in one object, ``MAX_NDIM`` dimensions per
tensor or array, ``MAX_INT_BYTES`` bytes per integer, and a memory budget: the values decoded
from ``n`` bytes may take at most ``DECODE_RATIO * n + DECODE_FLOOR`` bytes of memory (4n +
16 MiB). Every value is charged what it really costs as a Python object (``decode_cost``: an empty
tensor about 540 bytes from 19 on the wire, a ``torch.Size`` 64), measured on CPython 3.11 and
torch 2.13 and rounded up, before it is allocated; a payload of many small values is refused
(``ValueError``) when the charges pass the budget, and ``encode`` refuses (``TypeError``) what
``loads`` would. Tensor and array data costs its own size, so a state of tensors stays near 1×.

Layout (all integers little-endian): ``MAGIC`` (8 bytes), ``VERSION`` (1 byte), then one value,
then nothing. A value is a tag byte and:

| tag | contents |
| --- | --- |
| NONE, FALSE, TRUE | nothing |
| INT | 8 bytes, signed |
| BIGINT | u32 n, n bytes two's complement, signed (for ints outside 64 bits) |
| FLOAT / COMPLEX | 8 / 16 bytes, IEEE 754 binary64 (real, imaginary) |
| STR / BYTES | u64 n, n bytes (UTF-8 for STR) |
| LIST / TUPLE | u64 n, n values |
| DICT | u64 n, n (key, value) pairs |
| ORDERED_DICT | u64 n, n pairs, then one value: ``_metadata`` (a dict) or NONE |
| TENSOR / NDARRAY | u8 dtype code, u8 ndim, ndim × u64 dims, u64 nbytes, nbytes raw bytes (row-major) |
| NP_SCALAR | u8 dtype code, itemsize raw bytes |
| SIZE | u8 n, n × u64 |
| DTYPE | u8 dtype code |

Tensor and array contents are written as views of their memory (``encode()`` copies nothing
large; ``Encoded.copy_into`` writes each buffer once), and read with one copy each.
"""

from __future__ import annotations

import collections
import functools
import struct
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from elastic.ring import decode_cost as _cost
from elastic.ring.decode_cost import DECODE_FLOOR, DECODE_RATIO

MAGIC = b"\x89elastic"
VERSION = 1

MAX_DEPTH = 100
MAX_ITEMS = 1 << 24
MAX_NDIM = 64
MAX_INT_BYTES = 1 << 16

# Tags: a value's first byte. Numbers are part of the format: never reuse one.
NONE, FALSE, TRUE, INT, BIGINT, FLOAT, COMPLEX, STR, BYTES = range(9)
LIST, TUPLE, DICT, ORDERED_DICT = 16, 17, 18, 19
TENSOR, NDARRAY, NP_SCALAR, SIZE, DTYPE = 32, 33, 34, 35, 36

# Dict keys: str and bytes hash with a per-process random key; 64-bit ints collide at most a few
# at a time. Floats and big ints can be picked to share one hash, making a dict quadratic to build.
_KEY_TAGS = frozenset((NONE, FALSE, TRUE, INT, STR, BYTES))
_KEY_TYPES = (type(None), bool, int, str, bytes)

# torch dtypes by code (part of the format). Resolved by these fixed names when torch is first
# needed; a name this torch lacks is simply not carried.
_TORCH_DTYPE_NAMES = {
    1: "float16", 2: "bfloat16", 3: "float32", 4: "float64", 5: "complex64", 6: "complex128",
    7: "int8", 8: "int16", 9: "int32", 10: "int64", 11: "uint8", 12: "bool",
    13: "uint16", 14: "uint32", 15: "uint64", 16: "complex32", 17: "float8_e4m3fn", 18: "float8_e5m2",
}
# numpy dtypes by code (part of the format), little-endian.
_NUMPY_DTYPES = {
    1: np.dtype("<f2"), 3: np.dtype("<f4"), 4: np.dtype("<f8"), 5: np.dtype("<c8"), 6: np.dtype("<c16"),
    7: np.dtype("i1"), 8: np.dtype("<i2"), 9: np.dtype("<i4"), 10: np.dtype("<i8"), 11: np.dtype("u1"),
    12: np.dtype("?"), 13: np.dtype("<u2"), 14: np.dtype("<u4"), 15: np.dtype("<u8"),
}
_NUMPY_CODES = {(d.kind, d.itemsize): code for code, d in _NUMPY_DTYPES.items()}

_LITTLE_ENDIAN = sys.byteorder == "little"
_LARGE = 64 << 10  # buffers at least this big are referenced, not copied, by encode()
_INT64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_FLOAT = struct.Struct("<d")
_COMPLEX = struct.Struct("<dd")

@functools.lru_cache(maxsize=None)
def _torch_tables() -> Tuple[Any, Dict[int, Any], Dict[Any, int]]:
    """torch and its dtype tables, made once (torch is imported only when a value needs it)."""
    import torch
    dtypes = {c: getattr(torch, n) for c, n in _TORCH_DTYPE_NAMES.items() if hasattr(torch, n)}
    by_code = {c: (d, d.itemsize) for c, d in dtypes.items()}
    return torch, by_code, {d: c for c, d in dtypes.items()}


def _torch(needed_for: Optional[str] = None):
    """torch and its dtype tables; on decode (``needed_for``) a missing torch is bad data here."""
    try:
        return _torch_tables()
    except ImportError:
        if needed_for is None:
            raise
        raise ValueError(f"{needed_for}: the data holds a torch value, but torch is not installed") from None


# --------------------------------------------------------------------------- encoding
class Encoded:
    """An encoded object: ``nbytes`` long, held as ``chunks`` (bytes, and memoryviews of the
    tensors and arrays it holds: keep those unchanged until the bytes are written)."""

    __slots__ = ("chunks", "nbytes")

    def __init__(self, chunks: List[Union[bytes, memoryview]]):
        self.chunks = chunks
        self.nbytes = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)

    def tobytes(self) -> bytes:
        return b"".join(self.chunks)

    def hash_into(self, h: Any) -> Any:
        """Feeds the bytes to ``h`` (a ``hashlib`` object) without joining them; returns ``h``."""
        for c in self.chunks:
            h.update(c)
        return h

    def copy_into(self, out: Any) -> None:
        """Writes the bytes into ``out``, a writable buffer of exactly ``nbytes`` bytes."""
        view = memoryview(out).cast("B")
        if view.nbytes != self.nbytes:
            raise ValueError(f"copy_into: the buffer holds {view.nbytes} bytes, the encoding {self.nbytes}")
        pos = 0
        for c in self.chunks:
            n = len(c) if isinstance(c, bytes) else c.nbytes
            view[pos:pos + n] = c
            pos += n


class _Refused(TypeError):
    """An object the format cannot carry; ``path`` grows on the way out of the containers."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what
        self.path: List[str] = []

    def __str__(self) -> str:
        where = "".join(reversed(self.path))
        return f"{self.what} at {where}" if where else self.what


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _refuse(obj: Any, why: str = "") -> _Refused:
    return _Refused(f"a value of type {_type_name(obj)} cannot be carried{': ' + why if why else ''} (the format "
                    "carries None, bool, int, float, complex, str, bytes, list, tuple, dict, OrderedDict, "
                    "torch.Tensor, numpy.ndarray, numpy scalars, torch.Size and torch.dtype)")


class _Encoder:
    def __init__(self, dry: bool):
        self.dry = dry  # check only: walk and validate, write nothing large
        self.chunks: List[Union[bytes, memoryview]] = []
        self.small = bytearray()
        self.items = 0
        self.cost = 0      # what the values take once decoded (see _cost), as the decoder charges it
        self.skipped = 0   # bytes a dry walk did not write

    def nbytes(self) -> int:
        return len(self.small) + self.skipped + sum(len(c) if isinstance(c, bytes) else c.nbytes for c in self.chunks)

    def check_budget(self) -> None:
        """Refuses what the decoder would: values costing more than the encoding may decode to."""
        if self.cost > _cost.budget(self.nbytes()):
            raise _Refused(f"an object of {_cost.over_budget(self.cost, self.nbytes())}")

    def finish(self) -> List[Union[bytes, memoryview]]:
        if self.small:
            self.chunks.append(bytes(self.small))
            self.small.clear()
        return self.chunks

    def raw(self, view: memoryview) -> None:
        if self.dry:
            self.skipped += view.nbytes
            return
        if view.nbytes < _LARGE:
            self.small += view
        else:
            self.finish()
            self.chunks.append(view)

    def count(self, obj: Any) -> None:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise _Refused(f"more than {MAX_ITEMS} values in one object (hold long sequences in a numpy array or "
                           "tensor)")

    def value(self, obj: Any, depth: int) -> None:
        self.count(obj)
        t = type(obj)
        out = self.small
        if obj is None:
            out.append(NONE)
        elif t is bool:
            out.append(TRUE if obj else FALSE)
        elif t is int:
            if -(1 << 63) <= obj < (1 << 63):
                out.append(INT)
                out += _INT64.pack(obj)
                self.cost += _cost.INT
            else:
                n = (obj.bit_length() + 8) // 8  # room for the sign bit
                if n > MAX_INT_BYTES:
                    raise _Refused(f"an int of {obj.bit_length()} bits is larger than {MAX_INT_BYTES * 8} bits")
                out.append(BIGINT)
                out += n.to_bytes(4, "little") + obj.to_bytes(n, "little", signed=True)
                self.cost += _cost.bigint(n)
        elif t is float:
            out.append(FLOAT)
            out += _FLOAT.pack(obj)
            self.cost += _cost.FLOAT
        elif t is complex:
            out.append(COMPLEX)
            out += _COMPLEX.pack(obj.real, obj.imag)
            self.cost += _cost.COMPLEX
        elif t is str:
            try:
                data = obj.encode("utf-8", "surrogatepass")
            except UnicodeEncodeError as e:  # pragma: no cover - surrogatepass takes every str
                raise _Refused(f"a str that is not UTF-8 encodable: {e}") from None
            out.append(STR)
            out += _U64.pack(len(data))
            self.raw(memoryview(data))
            self.cost += _cost.str_(len(obj), _cost.str_width(obj))
        elif t is bytes:
            out.append(BYTES)
            out += _U64.pack(len(obj))
            self.raw(memoryview(obj))
            self.cost += _cost.BYTES + len(obj)
        elif t is list or t is tuple:
            self.sequence(obj, LIST if t is list else TUPLE, depth)
        elif t is dict or t is collections.OrderedDict:
            self.mapping(obj, depth)
        elif t is np.ndarray:
            self.ndarray(obj)
        elif isinstance(obj, np.generic) and t.__module__ == "numpy":
            code = _NUMPY_CODES.get((obj.dtype.kind, obj.dtype.itemsize))
            if code is None:
                raise _refuse(obj, f"dtype {obj.dtype} (carried: bool, int, uint, float and complex dtypes)")
            self.cost += _cost.NP_SCALAR
            out.append(NP_SCALAR)
            out.append(code)
            out += np.asarray(obj).astype(_NUMPY_DTYPES[code]).tobytes()
        else:
            torch = sys.modules.get("torch")  # a torch value can only exist if torch is imported
            if torch is not None and isinstance(obj, torch.Tensor):
                self.tensor(obj)
            elif torch is not None and t is torch.Size:
                if len(obj) > MAX_NDIM:
                    raise _Refused(f"a torch.Size of {len(obj)} dimensions (more than {MAX_NDIM})")
                out.append(SIZE)
                out.append(len(obj))
                for d in obj:
                    out += _U64.pack(d)
                self.cost += _cost.size(len(obj))
            elif torch is not None and t is torch.dtype:
                code = _torch()[2].get(obj)
                if code is None:
                    raise _refuse(obj, f"{obj} is not among the carried dtypes")
                out.append(DTYPE)
                out.append(code)
            else:
                raise _refuse(obj)

    def sequence(self, obj: Any, tag: int, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep")
        self.small.append(tag)
        self.small += _U64.pack(len(obj))
        self.cost += _cost.sequence(tag == LIST, len(obj))
        for i, v in enumerate(obj):
            try:
                self.value(v, depth + 1)
            except _Refused as e:
                e.path.append(f"[{i}]")
                raise

    def mapping(self, obj: Any, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep")
        ordered = type(obj) is collections.OrderedDict
        self.small.append(ORDERED_DICT if ordered else DICT)
        self.small += _U64.pack(len(obj))
        self.cost += _cost.mapping(ordered, len(obj))
        for k, v in obj.items():
            if type(k) not in _KEY_TYPES or (type(k) is int and not -(1 << 63) <= k < (1 << 63)):
                what = "an int key beyond 64 bits" if type(k) is int else f"a dict key of type {_type_name(k)}"
                raise _Refused(f"{what} (keys may be None, bool, a 64-bit int, str or bytes)")
            try:
                self.value(k, depth + 1)
                self.value(v, depth + 1)
            except _Refused as e:
                e.path.append(f"[{k!r}]")
                raise
        if ordered:
            meta = getattr(obj, "_metadata", None)
            if meta is not None and type(meta) not in (dict, collections.OrderedDict):
                raise _Refused(f"an OrderedDict's _metadata of type {_type_name(meta)} (a dict is carried)")
            try:
                self.value(meta, depth + 1)
            except _Refused as e:
                e.path.append("._metadata")
                raise

    def _shape(self, shape: Tuple[int, ...]) -> None:
        if len(shape) > MAX_NDIM:
            raise _Refused(f"{len(shape)} dimensions (more than {MAX_NDIM})")
        self.small.append(len(shape))
        for d in shape:
            self.small += _U64.pack(d)

    def ndarray(self, a: np.ndarray) -> None:
        code = _NUMPY_CODES.get((a.dtype.kind, a.dtype.itemsize)) if a.dtype.fields is None else None
        if code is None:
            raise _refuse(a, f"dtype {a.dtype} (carried: bool, int, uint, float and complex dtypes)")
        if a.ndim > MAX_NDIM:
            raise _Refused(f"an array of {a.ndim} dimensions (more than {MAX_NDIM})")
        self.cost += _cost.array(a.ndim, a.nbytes)
        if self.dry:
            self.skipped += 3 + 8 * a.ndim + 8 + a.nbytes   # tag, dtype, ndim, dims, byte count, data
            return
        if not a.flags.c_contiguous:
            a = a.copy(order="C")
        if a.dtype != _NUMPY_DTYPES[code]:  # big-endian: store little-endian
            a = a.astype(_NUMPY_DTYPES[code])
        self.small.append(NDARRAY)
        self.small.append(code)
        self._shape(a.shape)
        self.small += _U64.pack(a.nbytes)
        self.raw(memoryview(a.reshape(-1).view(np.uint8)))

    def tensor(self, t: Any) -> None:
        torch, _, codes = _torch()
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise _refuse(t, "a tensor subclass (a plain torch.Tensor is carried)")
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise _refuse(t, f"a {t.layout} tensor{' (quantized)' if t.is_quantized else ''} "
                             "(dense tensors are carried)")
        if t.device.type == "meta":
            raise _refuse(t, "a tensor on the meta device has no data")
        code = codes.get(t.dtype)
        if code is None:
            raise _refuse(t, f"dtype {t.dtype} is not among the carried dtypes")
        if t.dim() > MAX_NDIM:
            raise _Refused(f"a tensor of {t.dim()} dimensions (more than {MAX_NDIM})")
        if not _LITTLE_ENDIAN:  # pragma: no cover - the format stores tensor bytes as they are in memory
            raise _refuse(t, "tensors are carried on little-endian hosts only")
        nbytes = t.numel() * t.element_size()
        self.cost += _cost.tensor(t.dim(), nbytes)
        if self.dry:
            self.skipped += 3 + 8 * t.dim() + 8 + nbytes   # tag, dtype, ndim, dims, byte count, data
            return
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        self.small.append(TENSOR)
        self.small.append(code)
        self._shape(tuple(t.shape))
        self.small += _U64.pack(t.numel() * t.element_size())
        if t.numel():
            self.raw(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def encode(obj: Any) -> Encoded:
    """Encodes ``obj``; raises ``TypeError`` naming what cannot be carried and where it is."""
    enc = _Encoder(dry=False)
    enc.small += MAGIC
    enc.small.append(VERSION)
    enc.value(obj, 0)
    enc.check_budget()
    return Encoded(enc.finish())


def dumps(obj: Any) -> bytes:
    """``encode(obj)`` as one bytes object."""
    return encode(obj).tobytes()


def check(obj: Any) -> None:
    """Raises the ``TypeError`` that ``encode(obj)`` would, without copying or viewing any data."""
    enc = _Encoder(dry=True)
    enc.skipped = len(MAGIC) + 1
    enc.value(obj, 0)
    enc.check_budget()


# --------------------------------------------------------------------------- decoding
class _Decoder:
    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0
        self.items = 0
        self.cost = 0
        self.budget = _cost.budget(len(data))

    def fail(self, at: int, what: str) -> ValueError:
        return ValueError(f"malformed data at offset {at}: {what}")

    def charge(self, cost: int, at: int) -> None:
        """Counts what the value about to be made takes (``_cost``), before it is allocated."""
        self.cost += cost
        if self.cost > self.budget:
            raise self.fail(at, _cost.over_budget(self.cost, len(self.data)))

    def take(self, n: int, what: str) -> memoryview:
        left = len(self.data) - self.pos
        if n > left:
            raise self.fail(self.pos, f"{what} needs {n} bytes, {left} left (truncated?)")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def length(self, what: str) -> int:
        """A byte or element count: each element takes at least one byte, so none exceeds what is left."""
        at = self.pos
        n = self.u64(what)
        if n > len(self.data) - self.pos:
            raise self.fail(at, f"{what} {n} is more than the {len(self.data) - self.pos} bytes left")
        return n

    def shape(self, what: str) -> Tuple[int, ...]:
        at = self.pos
        ndim = self.u8(f"{what} dimension count")
        if ndim > MAX_NDIM:
            raise self.fail(at, f"{what} has {ndim} dimensions (at most {MAX_NDIM})")
        shape = tuple(self.u64(f"{what} dimension") for _ in range(ndim))
        if any(d >= 1 << 63 for d in shape):
            raise self.fail(at, f"{what} has a dimension of 2**63 or more")
        return shape

    def raw_array(self, what: str, shape: Tuple[int, ...], itemsize: int, start: int, cost) -> np.ndarray:
        """The data bytes of a tensor or array, checked against its shape and charged
        ``cost(ndim, nbytes)``: a read-only uint8 view of the payload, copied by the caller."""
        at = self.pos
        nbytes = self.length(f"{what} byte count")
        numel = 1
        for d in shape:
            numel *= d
        if nbytes != numel * itemsize:
            raise self.fail(at, f"{what} of shape {list(shape)} and {itemsize}-byte elements has {nbytes} bytes")
        self.charge(cost(len(shape), nbytes), start)
        return np.frombuffer(self.take(nbytes, what), dtype=np.uint8)

    def value(self, depth: int) -> Any:
        at = self.pos
        self.items += 1
        if self.items > MAX_ITEMS:
            raise self.fail(at, f"more than {MAX_ITEMS} values")
        tag = self.u8("a tag")
        if tag == NONE:
            return None
        if tag == FALSE:
            return False
        if tag == TRUE:
            return True
        if tag == INT:
            self.charge(_cost.INT, at)
            return _INT64.unpack(self.take(8, "an int"))[0]
        if tag == BIGINT:
            n = int.from_bytes(self.take(4, "a big int's length"), "little")
            if n > MAX_INT_BYTES:
                raise self.fail(at, f"an int of {n} bytes (at most {MAX_INT_BYTES})")
            self.charge(_cost.bigint(n), at)
            return int.from_bytes(self.take(n, "a big int"), "little", signed=True)
        if tag == FLOAT:
            self.charge(_cost.FLOAT, at)
            return _FLOAT.unpack(self.take(8, "a float"))[0]
        if tag == COMPLEX:
            self.charge(_cost.COMPLEX, at)
            return complex(*_COMPLEX.unpack(self.take(16, "a complex")))
        if tag == STR:
            return self.str(at)
        if tag == BYTES:
            n = self.length("a bytes length")
            self.charge(_cost.BYTES + n, at)
            return bytes(self.take(n, "bytes"))
        if tag in (LIST, TUPLE, DICT, ORDERED_DICT):
            if depth >= MAX_DEPTH:
                raise self.fail(at, f"nested more than {MAX_DEPTH} levels deep")
            if tag in (LIST, TUPLE):
                n = self.length("a list length" if tag == LIST else "a tuple length")
                self.charge(_cost.sequence(tag == LIST, n), at)
                out = [None] * n   # made at its size: a growing list would over-allocate
                for i in range(n):
                    out[i] = self.value(depth + 1)
                return out if tag == LIST else tuple(out)
            return self.mapping(at, tag == ORDERED_DICT, depth)
        if tag == TENSOR:
            return self.tensor()
        if tag == NDARRAY:
            return self.ndarray()
        if tag == NP_SCALAR:
            code = self.u8("a numpy scalar's dtype")
            dtype = _NUMPY_DTYPES.get(code)
            if dtype is None:
                raise self.fail(at, f"unknown numpy dtype code {code}")
            value = np.frombuffer(self.take(dtype.itemsize, "a numpy scalar"), dtype=dtype)
            if dtype.kind == "b" and value.view(np.uint8)[0] > 1:
                raise self.fail(at, "a numpy bool that is neither 0 nor 1")
            self.charge(_cost.NP_SCALAR, at)
            return value[0]
        if tag == SIZE:
            torch = _torch(f"offset {at}")[0]
            n = self.u8("a torch.Size's length")
            if n > MAX_NDIM:
                raise self.fail(at, f"a torch.Size of {n} dimensions (at most {MAX_NDIM})")
            dims = [self.u64("a torch.Size dimension") for _ in range(n)]
            if any(d >= 1 << 63 for d in dims):
                raise self.fail(at, "a torch.Size dimension of 2**63 or more")
            self.charge(_cost.size(n), at)
            return torch.Size(dims)
        if tag == DTYPE:
            code = self.u8("a torch dtype")
            by_code = _torch(f"offset {at}")[1]
            if code not in by_code:
                raise self.fail(at, f"unknown torch dtype code {code}")
            return by_code[code][0]
        raise self.fail(at, f"unknown tag {tag}")

    def str(self, at: int) -> str:
        n = self.length("a str length")
        data = self.take(n, "a str")
        if n > _cost.SHORT_STR:   # charged before it is made (up to 4 bytes a code point)
            self.charge(_cost.str_(*_cost.utf8_shape(data)), at)
        try:
            s = str(data, "utf-8", "surrogatepass")
        except UnicodeDecodeError as e:
            raise self.fail(at, f"a str that is not UTF-8 ({e.reason} at byte {e.start})") from None
        if n <= _cost.SHORT_STR:
            self.charge(_cost.str_(len(s), _cost.str_width(s)), at)
        return s

    def mapping(self, at: int, ordered: bool, depth: int) -> Any:
        out: Any = collections.OrderedDict() if ordered else {}
        n = self.length("a dict length")
        self.charge(_cost.mapping(ordered, n), at)
        for _ in range(n):
            key_at = self.pos
            if self.pos < len(self.data) and self.data[self.pos] not in _KEY_TAGS:
                raise self.fail(key_at, f"a dict key with tag {self.data[self.pos]} (keys are None, bool, "
                                        "64-bit int, str or bytes)")
            key = self.value(depth + 1)
            if key in out:
                raise self.fail(key_at, f"dict key {key!r} appears twice")
            out[key] = self.value(depth + 1)
        if ordered:
            meta_at = self.pos
            meta = self.value(depth + 1)
            if meta is not None:
                if type(meta) not in (dict, collections.OrderedDict):
                    raise self.fail(meta_at, f"an OrderedDict's _metadata is a {type(meta).__name__}, not a dict")
                out._metadata = meta
        return out

    def ndarray(self) -> np.ndarray:
        at = self.pos - 1
        code = self.u8("an array's dtype")
        dtype = _NUMPY_DTYPES.get(code)
        if dtype is None:
            raise self.fail(at, f"unknown numpy dtype code {code}")
        shape = self.shape("an array")
        raw = self.raw_array("an array", shape, dtype.itemsize, at, _cost.array)
        if dtype.kind == "b" and raw.size and raw.max() > 1:
            raise self.fail(at, "a bool array holds bytes other than 0 and 1")
        try:
            out = np.empty(shape, dtype=dtype)   # one object that owns its memory, filled once
        except (ValueError, MemoryError) as e:  # a shape numpy cannot make (too large, too many dimensions)
            raise self.fail(at, f"an array of shape {list(shape)}: {e}") from None
        if raw.size:
            out.reshape(-1).view(np.uint8)[:] = raw
        return out

    def tensor(self) -> Any:
        at = self.pos - 1
        torch, by_code, _ = _torch(f"offset {at}")
        code = self.u8("a tensor's dtype")
        if code not in by_code:
            raise self.fail(at, f"unknown torch dtype code {code}")
        dtype, itemsize = by_code[code]
        shape = self.shape("a tensor")
        raw = self.raw_array("a tensor", shape, itemsize, at, _cost.tensor)
        if dtype == torch.bool and raw.size and raw.max() > 1:
            raise self.fail(at, "a bool tensor holds bytes other than 0 and 1")
        try:
            out = torch.empty(shape, dtype=dtype)   # one tensor that owns its memory, filled once
        except (RuntimeError, ValueError, OverflowError) as e:
            raise self.fail(at, f"a tensor of shape {list(shape)}: {e}") from None
        if raw.size:
            out.view(-1).view(torch.uint8).numpy()[:] = raw
        return out


def loads(data: Any) -> Any:
    """Decodes what ``encode``/``dumps`` wrote (bytes, bytearray, memoryview or a uint8 array).

    Anything else, truncated, extended or corrupted, raises ``ValueError`` naming the offset
    and what was wrong there; no code named by the data runs. Tensors and arrays own their
    memory (``data`` may be reused afterwards).
    """
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise TypeError(f"loads: expected bytes or a byte buffer, got {type(data).__name__}") from None
    if len(view) < len(MAGIC) + 1 or view[:len(MAGIC)] != MAGIC:
        raise ValueError("malformed data at offset 0: not elastic.ring.serialization data (no magic number)")
    if view[len(MAGIC)] != VERSION:
        raise ValueError(f"malformed data at offset {len(MAGIC)}: format version {view[len(MAGIC)]}, "
                         f"this elastic-ring reads version {VERSION}")
    dec = _Decoder(view)
    dec.pos = len(MAGIC) + 1
    obj = dec.value(0)
    if dec.pos != len(view):
        raise dec.fail(dec.pos, f"{len(view) - dec.pos} bytes after the end of the value")
    return obj


__all__ = ["MAGIC", "VERSION", "MAX_DEPTH", "MAX_ITEMS", "MAX_NDIM", "MAX_INT_BYTES", "DECODE_RATIO", "DECODE_FLOOR",
           "Encoded", "encode", "dumps", "loads", "check"]
