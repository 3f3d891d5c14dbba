"""torch's *_object collectives on the elastic group, between real worker processes on a real ring:
plain data and tensors arrive; a hostile peer's pickle bomb, forged sizes and malformed bytes are
refused, naming it, before anything is built or allocated."""

from __future__ import annotations

import pytest
import pickle

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import elastic
from elastic.torchdist import objects
from elastic.ring import serialization
from elastic.ring.communicator import MAX_OBJECT_BYTES
from tests.native.harness import run_world

from .test_process_group import _on_default_group


def torchs_own_all_gather_object(*args, **kwargs):
    """torch's own all_gather_object, as code that took it before the elastic group existed holds it."""
    return c10d.all_gather_object._elastic_replaces(*args, **kwargs)


class _Bomb:
    def __reduce__(self):
        return (bytearray, (10 ** 9,))   # what the receiver's unpickler calls: a gigabyte, zeroed


BOMB = pickle.dumps(_Bomb(), protocol=4)
HOSTILE = 1


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _send_instead(payload: bytes, announced: int) -> None:
    """Makes this rank's object collectives send ``payload`` and announce ``announced`` bytes,
    whatever object it is given: on the elastic group's path, and on torch's own."""
    objects.encode_object = lambda obj: (serialization.Encoded([payload]), None, announced)
    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    c10d._object_to_tensor = lambda obj, device, group: (tensor.clone(), torch.tensor([announced], dtype=torch.long))


def _gather_from_a_hostile_peer(payload: bytes, announced: int):
    def body(rank: int, size: int):
        if rank == HOSTILE:
            _send_instead(payload, announced)
        before = peak_rss_mib()
        objs = [None] * size
        try:
            dist.all_gather_object(objs, {"rank": rank, "data": [1, 2.5, "x"]})
            outcome = ("received", type(objs[HOSTILE]).__name__)
        except elastic.BadPeerError as e:
            outcome = ("BadPeerError", e.peer_rank, e.op, str(e))
        grown = peak_rss_mib() - before
        # The ring is fine afterwards: the refusal was decided before anything was exchanged
        # that the ranks disagree on.
        t = torch.ones(3)
        dist.all_reduce(t)
        return outcome, grown, t.tolist()
    return _on_default_group(body)


@pytest.mark.slow
def test_a_pickle_bomb_sent_to_all_gather_object_is_refused_with_the_receivers_memory_unchanged():
    assert len(BOMB) < 128
    bitten = pickle.loads(BOMB)   # the bytes really are a bomb: unpickled, they take a gigabyte
    assert type(bitten) is bytearray and len(bitten) == 10 ** 9
    del bitten
    results = run_world(3, _gather_from_a_hostile_peer(BOMB, len(BOMB)), timeout=120)
    for rank in (0, 2):
        outcome, grown, after = results[rank]
        assert outcome[:3] == ("BadPeerError", HOSTILE, "all_gather_object"), outcome
        assert "the object rank 1 sent is malformed" in outcome[3] and "no magic number" in outcome[3]
        assert grown < 32, f"rank {rank}'s peak memory grew by {grown:.0f} MiB"
        assert after == [3.0] * 3


def test_a_forged_object_size_is_refused_before_anything_is_allocated():
    for announced in (-5, MAX_OBJECT_BYTES + 1, 1 << 60):
        results = run_world(3, _gather_from_a_hostile_peer(b"", announced), timeout=120)
        for rank in (0, 2):
            outcome, grown, after = results[rank]
            assert outcome[:3] == ("BadPeerError", HOSTILE, "all_gather_object"), outcome
            assert f"rank 1 announced an object of {announced} bytes (at most {MAX_OBJECT_BYTES})" in outcome[3]
            assert grown < 32 and after == [3.0] * 3


def _every_object_collective(rank: int, size: int):
    got = {}
    value = {"rank": rank, "t": torch.arange(3) * rank, "a": np.full(2, rank), "s": "é", "b": b"\x00"}
    objs = [None] * size
    dist.all_gather_object(objs, value)
    got["all_gather"] = ([o["rank"] for o in objs] == list(range(size))
                         and torch.equal(objs[2]["t"], torch.arange(3) * 2) and objs[1]["s"] == "é")
    gathered = [None] * size if rank == 1 else None
    dist.gather_object(value, gathered, dst=1)
    got["gather"] = [o["rank"] for o in gathered] == list(range(size)) if rank == 1 else gathered is None
    listed = [("from", 2), {"k": 1.5}] if rank == 2 else [None, None]
    dist.broadcast_object_list(listed, src=2)
    got["broadcast"] = listed == [("from", 2), {"k": 1.5}]
    mine = [None]
    dist.scatter_object_list(mine, [f"for {r}" for r in range(size)] if rank == 0 else None, src=0)
    got["scatter"] = mine == [f"for {rank}"]
    # torch's own function, as code that took it before the group existed holds it: it runs the
    # torch algorithm, and on this group it too carries elastic.ring.serialization's format.
    early = [None] * size
    torchs_own_all_gather_object(early, {"rank": rank}, group=elastic.process_group())
    got["torch's own"] = early == [{"rank": r} for r in range(size)]
    return got


def test_every_object_collective_carries_plain_data_and_tensors_on_the_elastic_group():
    for got in run_world(3, _on_default_group(_every_object_collective), timeout=120):
        assert got == {"all_gather": True, "gather": True, "broadcast": True, "scatter": True, "torch's own": True}


def _torchs_own_path_from_a_hostile_peer(rank: int, size: int):
    # One honest round first: torch's path allocates its own buffers the first time it runs, which
    # is not what this measures.
    warm = [None] * size
    torchs_own_all_gather_object(warm, {"rank": rank}, group=elastic.process_group())
    if rank == HOSTILE:
        _send_instead(BOMB, len(BOMB))
    before = peak_rss_mib()
    objs = [None] * size
    try:
        torchs_own_all_gather_object(objs, {"rank": rank}, group=elastic.process_group())
        outcome = "received"
    except ValueError as e:
        outcome = str(e)
    return outcome, peak_rss_mib() - before


def test_torchs_own_object_path_on_the_elastic_group_unpickles_nothing():
    results = run_world(3, _on_default_group(_torchs_own_path_from_a_hostile_peer), timeout=120)
    for rank in (0, 2):
        outcome, grown = results[rank]
        assert "not elastic.ring.serialization data (no magic number)" in outcome and grown < 32, results[rank]
