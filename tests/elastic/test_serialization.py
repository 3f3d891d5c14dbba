"""elastic.ring.serialization: what it carries comes back bit-exact, what it cannot carry is refused
by name, and hostile bytes only ever raise ValueError (never run code, never another error)."""

from __future__ import annotations

import collections
import enum
import json
import math
import os
import random
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import elastic
from elastic.ring import decode_cost
from elastic.ring import serialization as S

from .bait import planted_pickle, prove_it_bites
from .decode_memory import KINDS as WORST_CASE_KINDS


# --------------------------------------------------------------------------- bit-exact equality
def same(a, b) -> bool:
    """True when ``b`` is ``a`` to the bit: same types, dtypes, shapes, bytes, key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return struct.pack("<dd", a.real, a.imag) == struct.pack("<dd", b.real, b.imag)
    if isinstance(a, torch.Tensor):
        def raw(t):
            return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        return (a.dtype == b.dtype and a.shape == b.shape and not b.requires_grad and b.is_contiguous()
                and raw(a) == raw(b))
    if isinstance(a, np.ndarray):
        return (a.dtype.newbyteorder("<") == b.dtype and a.shape == b.shape and b.flags.c_contiguous
                and b.flags.writeable and a.astype(b.dtype).tobytes() == b.tobytes())
    if isinstance(a, np.generic):
        return a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        if getattr(a, "_metadata", None) is not None and not same(a._metadata, getattr(b, "_metadata", None)):
            return False
        return len(a) == len(b) and all(same(ka, kb) and same(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    return a == b


def round_trip(obj):
    data = S.dumps(obj)
    back = S.loads(data)
    assert same(obj, back), (obj, back)
    assert S.dumps(back) == data  # what comes back encodes to the same bytes
    return back


# --------------------------------------------------------------------------- what it carries
SCALARS = [
    None, True, False, 0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 63, -2 ** 63 - 1, 3 ** 500, -(7 ** 300),
    0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0],
    5e-324, 1 + 2j, complex(float("nan"), -0.0), "", "épée ∑ 🚀", "\ud800 lone surrogate", b"", b"\x00\xff" * 100,
    b"x" * (100 << 10),  # a large buffer is referenced, not copied, by encode()
]


@pytest.mark.parametrize("value", SCALARS, ids=lambda v: type(v).__name__)
def test_scalars_round_trip_bit_exact(value):
    round_trip(value)
    round_trip([value, (value,), {"k": value}])


TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.uint16,
                torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (2, 3, 4)], ids=str)
def test_tensors_of_every_dtype_round_trip_bit_exact(dtype, shape):
    raw = torch.randint(0, 256, (int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    if dtype == torch.bool:
        raw &= 1
    t = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
    back = round_trip(t)
    if t.numel():
        assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_views_parameters_and_conjugates_arrive_as_plain_contiguous_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in [base.t(), base[1:3, ::2], base[2], torch.nn.Parameter(base.clone()), base.expand(3, 4, 6),
              torch.tensor([1 + 2j, 3 - 4j]).conj(), -torch.tensor([1 + 2j]).conj()]:
        back = S.loads(S.dumps(t))
        assert type(back) is torch.Tensor and not back.requires_grad and back.is_contiguous()
        assert torch.equal(back, t.detach().resolve_conj().resolve_neg())


NUMPY_DTYPES = ["?", "i1", "<i2", "<i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
                ">f4", ">i8", ">c16"]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_arrays_and_scalars_round_trip_bit_exact(dtype):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=24 * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype).kind == "b":
        raw &= 1
    a = raw.view(dtype).reshape(2, 3, 4)
    for arr in [a, a[:, ::2, 1:], a[0, 0, 0:0], np.asarray(a[1, 2, 3])]:
        round_trip(arr)
    round_trip(a[1, 2, 3])  # a numpy scalar of that type
    round_trip(a[1, 2, 3][()])


def test_numpy_scalars_keep_their_type():
    for value in [np.float64(1.25), np.float32(-0.0), np.float16(3), np.int8(-5), np.uint64(2 ** 64 - 1),
                  np.bool_(True), np.complex64(1 - 1j), np.int64(7)]:
        back = round_trip(value)
        assert type(back) is type(value)


def test_containers_keep_types_order_and_ordered_dict_metadata():
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    od._metadata = collections.OrderedDict([("", {"version": 1})])
    obj = {3: "int key", "s": od, None: [], -(1 << 63): (), b"k": {}, 7: [[[]]], True: collections.OrderedDict(),
           "size": torch.Size([2, 0, 5]), "dtype": torch.bfloat16}
    back = round_trip(obj)
    assert list(back) == list(obj)
    assert type(back["s"]) is collections.OrderedDict and back["s"]._metadata == od._metadata
    assert type(back["size"]) is torch.Size and back["dtype"] is torch.bfloat16
    assert not hasattr(back[True], "_metadata")


def _trained(optimizer_cls, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    opt = optimizer_cls(model.parameters(), **kw)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=torch.tensor(0.01), weight_decay=0.1)),  # a tensor lr: in param_groups
], ids=lambda o: o[0].__name__)
def test_model_optimizer_scheduler_and_sampler_state_round_trip_bit_exact(optimizer):
    model, opt = _trained(optimizer[0], **optimizer[1])
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    opt.step()
    sched.step()
    sampler = elastic.ElasticSampler(list(range(50)), shuffle=True, seed=3)
    sampler.record_batch(0, 5)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "sampler": sampler.state_dict(), "torch_rng": torch.get_rng_state(), "np_rng": np.random.get_state(),
             "random": random.getstate(), "pcg": np.random.default_rng(5).bit_generator.state}
    back = round_trip(state)
    # And what comes back loads: a fresh model and optimizer take it and hold the same bits.
    model2, opt2 = _trained(optimizer[0], **optimizer[1])
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])
    assert same(model.state_dict(), model2.state_dict())
    assert same(opt.state_dict(), opt2.state_dict())


def test_encode_references_tensor_memory_instead_of_copying_it():
    t = torch.randn(1 << 20)  # 4 MiB
    a = np.arange(1 << 18, dtype=np.float64)
    enc = S.encode({"t": t, "a": a})
    views = [c for c in enc.chunks if isinstance(c, memoryview)]
    assert any(np.shares_memory(np.asarray(v), t.numpy()) for v in views)
    assert any(np.shares_memory(np.asarray(v), a) for v in views)
    out = np.empty(enc.nbytes, dtype=np.uint8)
    enc.copy_into(out)
    assert out.tobytes() == enc.tobytes()
    back = S.loads(out)
    out[:] = 0  # decoded tensors own their memory
    assert torch.equal(back["t"], t) and np.array_equal(back["a"], a)


# --------------------------------------------------------------------------- property
_keys = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1), st.text(max_size=8),
                  st.binary(max_size=8))
_numpy = hnp.arrays(dtype=st.sampled_from([np.dtype(d) for d in NUMPY_DTYPES]),
                    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-2 ** 300, max_value=2 ** 300),
    st.floats(allow_nan=True), st.complex_numbers(allow_nan=True), st.text(), st.binary(), _numpy,
    _numpy.map(lambda a: a[()] if a.ndim == 0 else a),  # numpy scalars too
    _numpy.filter(lambda a: a.dtype.isnative and a.dtype.kind != "u" or a.dtype.itemsize == 1)
          .map(lambda a: torch.from_numpy(a.copy())),
    _numpy.filter(lambda a: a.dtype == np.float32).map(lambda a: torch.from_numpy(a.copy()).to(torch.bfloat16)),
)


def _ordered(pairs):
    od = collections.OrderedDict(pairs)
    return od


_values = st.recursive(_leaves, lambda children: st.one_of(
    st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple),
    st.dictionaries(_keys, children, max_size=4),
    st.lists(st.tuples(_keys, children), max_size=4).map(_ordered),
), max_leaves=20)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values)
def test_any_carried_value_round_trips_bit_exact(value):
    round_trip(value)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(_values, st.data())
def test_any_damage_to_an_encoding_raises_only_value_error(value, data):
    encoded = bytearray(S.dumps(value))
    how = data.draw(st.sampled_from(["truncate", "flip", "extend", "overwrite"]))
    if how == "truncate":
        del encoded[data.draw(st.integers(0, len(encoded) - 1)):]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(encoded) - 1))
            encoded[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "extend":
        encoded += data.draw(st.binary(min_size=1, max_size=16))
    else:
        i = data.draw(st.integers(0, len(encoded) - 1))
        junk = data.draw(st.binary(min_size=1, max_size=9))
        encoded[i:i + len(junk)] = junk
    try:
        S.loads(bytes(encoded))
    except ValueError:
        pass  # anything else (IndexError, struct.error, MemoryError, RecursionError) fails the test


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_junk_after_a_valid_header_raises_only_value_error(junk):
    try:
        S.loads(S.MAGIC + bytes([S.VERSION]) + junk)
    except ValueError:
        pass


@pytest.mark.slow
def test_every_truncation_and_every_single_bit_flip_of_a_training_state_raises_only_value_error():
    model, opt = _trained(torch.optim.AdamW, lr=0.01)
    data = S.dumps((12, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                         "sampler": elastic.ElasticSampler(list(range(10))).state_dict()}))
    for n in range(len(data)):
        with pytest.raises(ValueError):
            S.loads(data[:n])
    rng = random.Random(0)
    for _ in range(3000):
        damaged = bytearray(data)
        i = rng.randrange(len(damaged))
        damaged[i] ^= 1 << rng.randrange(8)
        try:
            S.loads(bytes(damaged))
        except ValueError:
            pass


# --------------------------------------------------------------------------- hostile bytes
def _u64(n):
    return struct.pack("<Q", n)


HEADER = S.MAGIC + bytes([S.VERSION])
HOSTILE = [
    (b"", "no magic number"),
    (b"\x80\x04\x95", "no magic number"),
    (S.MAGIC + b"\x02" + bytes([S.NONE]), "format version 2"),
    (HEADER, "a tag needs 1 bytes"),
    (HEADER + bytes([S.NONE, S.NONE]), "1 bytes after the end of the value"),
    (HEADER + bytes([99]), "unknown tag 99"),
    (HEADER + bytes([S.INT]) + b"\x00" * 7, "an int needs 8 bytes, 7 left"),
    (HEADER + bytes([S.LIST]) + _u64(2 ** 63), "a list length 9223372036854775808 is more than the 0 bytes left"),
    (HEADER + bytes([S.STR]) + _u64(2 ** 64 - 1), "a str length"),
    (HEADER + bytes([S.STR]) + _u64(2) + b"\xff\xfe", "not UTF-8"),
    (HEADER + bytes([S.BIGINT]) + struct.pack("<I", 2 ** 32 - 1), "an int of 4294967295 bytes"),
    (HEADER + bytes([S.DICT]) + _u64(1) + bytes([S.LIST]) + _u64(0) + bytes([S.NONE]), "keys are None, bool"),
    (HEADER + bytes([S.DICT]) + _u64(2) + bytes([S.TRUE, S.NONE]) + bytes([S.INT]) + struct.pack("<q", 1)
     + bytes([S.NONE]), "dict key 1 appears twice"),  # True == 1: one key, twice
    (HEADER + bytes([S.ORDERED_DICT]) + _u64(0) + bytes([S.LIST]) + _u64(0), "_metadata is a list"),
    (HEADER + bytes([S.TENSOR, 200]), "unknown torch dtype code 200"),
    (HEADER + bytes([S.TENSOR, 3, 65]), "65 dimensions"),
    (HEADER + bytes([S.TENSOR, 3, 2]) + _u64(2 ** 62) + _u64(2 ** 62) + _u64(0), "has 0 bytes"),
    (HEADER + bytes([S.TENSOR, 3, 1]) + _u64(2 ** 63) + _u64(0), "dimension of 2**63"),
    (HEADER + bytes([S.TENSOR, 3, 1]) + _u64(4) + _u64(16) + b"\x00" * 8, "byte count 16 is more than the 8 bytes left"),
    (HEADER + bytes([S.TENSOR, 12, 1]) + _u64(2) + _u64(2) + b"\x01\x02", "bool tensor holds bytes other"),
    (HEADER + bytes([S.NDARRAY, 12, 1]) + _u64(1) + _u64(1) + b"\x07", "bool array holds bytes other"),
    (HEADER + bytes([S.NDARRAY, 77]), "unknown numpy dtype code 77"),
    (HEADER + bytes([S.NDARRAY, 3, 2]) + _u64(0) + _u64(2 ** 62) + _u64(0), "an array of shape [0, 4611686018427387904]"),
    (HEADER + bytes([S.NP_SCALAR, 12, 9]), "neither 0 nor 1"),
    (HEADER + bytes([S.SIZE, 1]) + _u64(2 ** 64 - 1), "torch.Size dimension of 2**63"),
    (HEADER + bytes([S.DTYPE, 0]), "unknown torch dtype code 0"),
    (HEADER + bytes([S.LIST]) + _u64(1) + bytes([S.LIST]) + _u64(1) + bytes([S.LIST]), "a list length needs"),
]


@pytest.mark.parametrize("data,why", HOSTILE, ids=[w for _, w in HOSTILE])
def test_hostile_bytes_raise_value_error_naming_offset_and_what(data, why):
    with pytest.raises(ValueError, match="malformed data at offset") as e:
        S.loads(data)
    assert why in str(e.value)


def test_a_nesting_bomb_is_refused_at_the_depth_limit_not_by_recursion_error():
    bomb = HEADER + (bytes([S.LIST]) + _u64(1)) * 100_000 + bytes([S.NONE])
    with pytest.raises(ValueError, match=f"nested more than {S.MAX_DEPTH} levels deep"):
        S.loads(bomb)
    deep = None
    for _ in range(S.MAX_DEPTH):
        deep = [deep]
    round_trip(deep)
    with pytest.raises(TypeError, match="nested more than"):
        S.dumps([deep])


def test_the_value_count_limit_holds_on_both_sides(monkeypatch):
    monkeypatch.setattr(S, "MAX_ITEMS", 1000)
    data = HEADER + bytes([S.LIST]) + _u64(1000) + bytes([S.NONE]) * 1000  # 1001 values with the list
    with pytest.raises(ValueError, match="more than 1000 values"):
        S.loads(data)
    with pytest.raises(TypeError, match="more than 1000 values"):
        S.dumps([None] * 1000)
    S.loads(S.dumps([None] * 999))


def test_a_planted_pickle_is_never_unpickled(tmp_path):
    marker = str(tmp_path / "pwned")
    bait = planted_pickle(marker)
    prove_it_bites(bait, marker)
    for data in [bait, HEADER + bait, HEADER + bytes([S.BYTES]) + _u64(len(bait)) + bait]:
        try:
            value = S.loads(data)
        except ValueError:
            continue
        assert value == bait  # carried as bytes, and only as bytes
    assert not os.path.exists(marker)


# --------------------------------------------------------------------------- what it refuses
class _Thing:
    pass


class _Color(enum.IntEnum):
    RED = 1


class _MyTensor(torch.Tensor):
    pass


class _MyArray(np.ndarray):
    pass


def _quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, and still exist
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)


REFUSED = [
    (lambda: 1, "a value of type function"),
    ({1, 2}, "a value of type set"),
    (frozenset(), "a value of type frozenset"),
    (_Thing(), "_Thing"),
    (collections.defaultdict(list), "collections.defaultdict"),
    (_Color.RED, "_Color"),
    (bytearray(b"x"), "bytearray"),
    (np.array([object()], dtype=object), "dtype object"),
    (np.zeros(2, dtype=[("a", "<i4")]), "dtype"),
    (np.array(["x"]), "dtype <U1"),
    (np.zeros(2).view(_MyArray), "_MyArray"),
    (np.datetime64("2020-01-01"), "datetime64"),
    (torch.zeros(2, 2).to_sparse(), "torch.sparse_coo"),
    (_quantized(), "quantized"),
    (torch.empty(2, device="meta"), "meta device"),
    (torch.zeros(2).as_subclass(_MyTensor), "a tensor subclass"),
    (torch.device("cpu"), "torch.device"),
    (2 ** (S.MAX_INT_BYTES * 8 + 1), "bits is larger than"),
    ({(1, 2): 3}, "a dict key of type tuple"),
    ({1.5: 0}, "a dict key of type float"),
    ({1j: 0}, "a dict key of type complex"),
    ({1 << 63: 0}, "an int key beyond 64 bits"),
]


@pytest.mark.parametrize("value,why", REFUSED, ids=[w for _, w in REFUSED])
def test_what_it_cannot_carry_is_refused_with_type_error_naming_it_and_where(value, why):
    for check in (S.dumps, S.check):
        with pytest.raises(TypeError) as e:
            check({"outer": [0, {"inner": value}]})
        assert why in str(e.value)
        assert "at ['outer'][1]" in str(e.value)


def test_check_accepts_what_encode_accepts_without_copying():
    model, opt = _trained(torch.optim.SGD, lr=0.1, momentum=0.9)
    S.check({"model": model.state_dict(), "optimizer": opt.state_dict(), "x": math.pi})


def test_loads_takes_bytes_bytearray_memoryview_and_uint8_arrays():
    data = S.dumps({"a": 1})
    for form in (data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        assert S.loads(form) == {"a": 1}
    with pytest.raises(TypeError, match="expected bytes"):
        S.loads("not bytes")


def test_keys_that_can_share_one_hash_are_refused_before_any_dict_is_built():
    # Big ints k * (2**61 - 1) all hash to 0 in CPython: 16,000 of them took seconds to insert.
    # Hand-made bytes with such keys (tag BIGINT, and FLOAT) are refused at the first key.
    colliding = {k * ((1 << 61) - 1): 0 for k in range(5, 7)}   # beyond 64 bits from k = 5
    with pytest.raises(TypeError, match="an int key beyond 64 bits"):
        S.dumps(colliding)
    for key in (S.BIGINT, S.FLOAT):
        data = HEADER + bytes([S.DICT]) + struct.pack("<Q", 2) + bytes([key]) + bytes(64)
        with pytest.raises(ValueError, match=f"a dict key with tag {key} "):
            S.loads(data)


DECODE_MEMORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_memory.py")


@pytest.mark.slow
@pytest.mark.parametrize("kind", WORST_CASE_KINDS)
def test_decoding_a_worst_case_payload_of_each_kind_takes_at_most_its_budget_in_peak_memory(kind):
    # 8 MiB of the cheapest encoding of one value kind, decoded in a process of its own: its peak
    # resident memory grows by at most 4x the payload plus the 16 MiB floor, whether the payload
    # is decoded or refused part-way (the old format reached 21x for empty tensors, 36x for sizes).
    mib = 8
    run = subprocess.run([sys.executable, DECODE_MEMORY, kind, str(mib)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(
                             os.path.dirname(DECODE_MEMORY)))})
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["payload"] >= (mib << 20) - 64
    assert report["grown"] <= S.DECODE_RATIO * report["payload"] + S.DECODE_FLOOR, report
    assert report["outcome"].startswith(("decoded", "refused: malformed data")), report


def test_many_small_values_are_refused_on_both_sides_by_the_memory_budget(monkeypatch):
    # Without the 16 MiB floor (made 0 here, so the lists stay small): 10^5 Nones are 100 KB on
    # the wire and 800 KB of list slots, more than 4x; 10^5 floats (9 bytes, 32 once decoded) fit.
    monkeypatch.setattr(decode_cost, "DECODE_FLOOR", 0)
    n = 100_000
    with pytest.raises(TypeError, match=r"once decoded, over the .* \(4x \+ 0 MiB\)"):
        S.dumps([None] * n)
    with pytest.raises(TypeError, match="once decoded"):
        S.check([None] * n)
    data = HEADER + bytes([S.LIST]) + _u64(n) + bytes([S.NONE]) * n
    with pytest.raises(ValueError, match=r"malformed data at offset 9: values that take \d+ bytes"):
        S.loads(data)
    assert S.loads(S.dumps([1.5] * n)) == [1.5] * n
    # Empty tensors cost about 640 bytes each from 27 on the wire: refused long before 2^24 values.
    empty = bytes([S.TENSOR, 3, 1]) + _u64(0) + _u64(0)
    with pytest.raises(ValueError, match="once decoded"):
        S.loads(HEADER + bytes([S.LIST]) + _u64(n) + empty * n)
    with pytest.raises(TypeError, match="once decoded"):
        S.dumps([torch.empty(0)] * 10_000)


def test_a_state_of_tensors_decodes_within_its_budget_at_any_size():
    state = {"w": torch.randn(1 << 20), "b": torch.zeros(0), "step": 7, "shape": torch.Size([3, 4]),
             "layers": [torch.randn(8, 8) for _ in range(1000)]}
    out = round_trip(state)
    assert out["step"] == 7 and len(out["layers"]) == 1000
