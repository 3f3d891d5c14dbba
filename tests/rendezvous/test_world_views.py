"""Each member's view of a world: what it names is what the ring needs, every view of one world
carries the same digest, and no message to a worker grows with the job's size (semantics 15)."""
from __future__ import annotations

import dataclasses

import pytest

from elastic.ring.ring_view import RingView
from rendezvous.client.worker_client import _world
from rendezvous.server import decision as d
from rendezvous.server import server_wire
from rendezvous.server.world_views import WorldViews, _varint, world_digest
from rendezvous.wire.messages import pb


def layout(*per_host: int) -> tuple[d.Member, ...]:
    """Members on hosts of `per_host` workers each, in rank order, each host's ranks contiguous."""
    members, hosts_with = [], lambda lr: sum(1 for k in per_host if k > lr)
    for h, k in enumerate(per_host):
        for lr in range(k):
            members.append(d.Member(f"w{len(members):05d}", f"host-{h:04d}", f"10.{h // 250}.{h % 250}.1:{4000 + lr}",
                                    len(members), lr, k, sum(1 for x in per_host[:h] if x > lr), hosts_with(lr), -1))
    return tuple(members)


LAYOUTS = {
    "one": layout(1),
    "flat": layout(1, 1, 1, 1, 1),
    "one-host": layout(6),
    "hierarchical": layout(4, 4, 4),
    "mixed": layout(3, 1, 2, 5, 1),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_view_names_exactly_the_ranks_the_ring_connects_to(name):
    members = LAYOUTS[name]
    views = WorldViews(3, members)
    addresses, hosts = [m.ring_address for m in members], [m.host for m in members]
    for m in members:
        got = RingView.of_world(_world(views.world(m)))
        want = RingView.of_full_list(m.rank, addresses, hosts)
        # The same neighbours, hosts and layout as a ring formed from the full list; only the
        # digest differs (the server's names worker ids too).
        assert dataclasses.replace(got, digest=want.digest) == want, m
        assert got.problem() is None and got.digest == world_digest(members)


def test_every_view_of_one_world_has_its_digest_and_another_world_another():
    members = LAYOUTS["mixed"]
    views = WorldViews(1, members)
    assert {views.world(m).digest for m in members} == {world_digest(members)}
    moved = (dataclasses.replace(members[0], ring_address="10.9.9.9:1"),) + members[1:]
    renamed = (dataclasses.replace(members[-1], worker_id="other"),) + members[:-1]
    assert len({world_digest(members), world_digest(moved), world_digest(renamed)}) == 3


def test_views_go_only_to_members_with_a_stream():
    views = WorldViews(1, LAYOUTS["flat"])
    assert [w for w, _ in views.pending({"w00002", "stranger"})] == ["w00002"]
    (_, pending), = views.pending({"w00002"})
    assert pb.WatchEvent.FromString(pending.serialized()) == views.event(views.member("w00002"))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_view_serialized_field_by_field_is_the_view(name):
    views = WorldViews(2**40 + 3, LAYOUTS[name])   # a version whose varint takes six bytes
    aborted = pb.AbortVersion(world_version=2**40 + 2, reason="worker w00001 evicted: " + "x" * 200,
                              acknowledge=True)
    for m in views.members:
        for abort in (None, aborted):
            sent = views.serialized_event(m, abort)
            assert pb.WatchEvent.FromString(sent) == views.event(m, abort), (m, abort)
            assert len(sent) == views.event(m, abort).ByteSize()


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16_383, 16_384, 2**32 - 1, 2**63])
def test_varint_is_protobufs(n):
    # A uint64 field of number 1 is its tag (0x08) and then the value as a varint.
    assert _varint(n) == pb.World(world_version=n).SerializeToString()[1:] or n == 0
    assert pb.World.FromString(b"\x08" + _varint(n)).world_version == n


def _largest_event(members: tuple[d.Member, ...]) -> int:
    """The largest message the server sends any worker of this world, of every kind it sends one."""
    views = WorldViews(7, members)
    state = dataclasses.replace(d.new_job("j", d.JobSpec(1, len(members), 60.0), 0.0), world_version=7,
                                world=members, phase=d.Phase.RUNNING, aborted_version=7)
    sizes = [len(views.serialized_event(m)) for m in members]
    sizes += [e.ByteSize() for e in server_wire.snapshot(state, views, members[-1].worker_id, 0.0)]
    sizes += [server_wire.notice_event(d.AnnounceAbort(7, "worker w00001 on host host-0000 evicted")).ByteSize(),
              server_wire.standby_event(7, server_wire.standby_reason(state, "spare", 0.0)).ByteSize()]
    return max(sizes)


@pytest.mark.slow
def test_no_message_to_a_worker_grows_with_the_job():
    # 8 workers a host, and the same with one odd host of 3 (a mixed world): the largest
    # message of 16,384 workers is the size of that of 64, but for the digits of larger ranks.
    for odd in ((), (3,)):
        small = _largest_event(layout(*([8] * 8), *odd))
        large = _largest_event(layout(*([8] * 2048), *odd))
        assert large <= small + 64, (small, large)
        assert large <= 4096, large   # the bound per worker and world change, with room
