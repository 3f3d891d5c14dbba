"""The store a world's device communicator meets over: a real TCPStore hosted as rank 0 hosts it,
values MACed with the job's secret (forged, moved and replayed values refused), a prefix no two
worlds share, and gloo meeting over it as NCCL would."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from elastic.torchdist import device_store
from elastic.torchdist.device_backend import make_gloo
from elastic.torchdist.device_store import ForgedValueError, HostedStore, Meeting, SignedStore, world_key

SECRET = b"s" * 32
TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def hosted():
    h = HostedStore("127.0.0.1", TIMEOUT)
    yield h
    h.close()


def signed(inner, meeting, version=3, secret=SECRET, job="job"):
    return SignedStore(inner, world_key(secret, job, version, meeting.nonce), meeting.prefix(job, version))


def test_members_read_what_members_wrote(hosted):
    meeting = Meeting("127.0.0.1", hosted.port, device_store.new_nonce())
    rank0 = signed(hosted.store, meeting)
    rank1 = signed(device_store.connect(meeting, TIMEOUT), meeting)
    rank0.set("ncclUniqueId", b"\x01\x02 bootstrap")
    assert rank1.get("ncclUniqueId") == b"\x01\x02 bootstrap"
    rank1.wait(["ncclUniqueId"])
    assert rank1.check(["ncclUniqueId"]) and rank1.add("counter", 2) == 2


def test_a_value_an_outsider_wrote_is_refused(hosted):
    meeting = Meeting("127.0.0.1", hosted.port, device_store.new_nonce())
    member = signed(device_store.connect(meeting, TIMEOUT), meeting)
    outsider = device_store.connect(meeting, TIMEOUT)   # reached the port; knows the prefix, not the secret
    outsider.set(meeting.prefix("job", 3) + "ncclUniqueId", b"\0" * 32 + b"attacker's bootstrap address")
    with pytest.raises(ForgedValueError, match="not written by a member of this world"):
        member.get("ncclUniqueId")
    outsider.set(meeting.prefix("job", 3) + "short", b"x")
    with pytest.raises(ForgedValueError):
        member.get("short")


def test_a_signed_value_moved_to_another_key_or_world_is_refused(hosted):
    meeting = Meeting("127.0.0.1", hosted.port, device_store.new_nonce())
    member = signed(hosted.store, meeting)
    member.set("rank_1", b"10.0.0.2:4000")
    raw = hosted.store.get(meeting.prefix("job", 3) + "rank_1")
    hosted.store.set(meeting.prefix("job", 3) + "rank_0", raw)   # moved to another key
    with pytest.raises(ForgedValueError):
        member.get("rank_0")
    later = Meeting("127.0.0.1", hosted.port, device_store.new_nonce())
    later_world = signed(hosted.store, later, version=4)
    hosted.store.set(later.prefix("job", 4) + "rank_1", raw)     # replayed into the next world
    with pytest.raises(ForgedValueError):
        later_world.get("rank_1")
    other_job = signed(hosted.store, meeting, secret=b"t" * 32)  # another job's secret
    with pytest.raises(ForgedValueError):
        other_job.get("rank_1")


def test_no_two_worlds_share_a_prefix_even_of_one_version():
    prefixes = {Meeting("h", 1, device_store.new_nonce()).prefix("job", v) for v in (1, 1, 2, 2, 3) for _ in range(50)}
    assert len(prefixes) == 250
    assert all(p.startswith("elastic/job/world") and p.endswith("/") for p in prefixes)


def test_split_host_reads_v4_v6_and_names():
    assert device_store.split_host("10.1.2.3:4567") == "10.1.2.3"
    assert device_store.split_host("[fe80::1]:4567") == "fe80::1"
    assert device_store.split_host("node-7:4567") == "node-7"


def test_gloo_meets_over_the_signed_store_and_reduces(hosted):
    meeting = Meeting("127.0.0.1", hosted.port, device_store.new_nonce())
    stores = [signed(hosted.store, meeting), signed(device_store.connect(meeting, TIMEOUT), meeting)]
    results, errors = [None, None], []

    def rank(r):
        try:
            backend = make_gloo(stores[r], 3, r, 2, timeout=10)
            t = torch.full((4,), float(r + 1))
            backend.finish(backend.run("allreduce", [t], _sum()))
            results[r] = t
            backend.close()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(torch.equal(r, torch.full((4,), 3.0)) for r in results)


def _sum():
    import torch.distributed as dist
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts
