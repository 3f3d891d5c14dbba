"""Table tests of the wire forms: pure functions, no sockets. What a refusal's status is, what a
(re)attaching worker is sent first, and that the spliced world is the world each member would get."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from rendezvous import decision as d
from rendezvous import wire
from rendezvous._proto import rendezvous_pb2 as pb

@pytest.mark.parametrize("kind, code", [
    (d.Refusal.FINISHED, grpc.StatusCode.FAILED_PRECONDITION),
    (d.Refusal.BLACKLISTED, grpc.StatusCode.FAILED_PRECONDITION),
    (d.Refusal.WORKER_EXISTS, grpc.StatusCode.ALREADY_EXISTS),
    (d.Refusal.NOT_MEMBER, grpc.StatusCode.PERMISSION_DENIED),
])
def test_a_refusal_gets_its_code_from_its_kind(kind, code):
    e = wire.refusal(d.Rejected("w", "why", kind), "job j: why")
    assert (e.code, e.message) == (code, "job j: why")


@pytest.mark.parametrize("leader, metadata", [("", ()), ("10.0.0.1:29400", (("leader", "10.0.0.1:29400"),))])
def test_a_status_error_carries_the_leader_hint_as_trailing_metadata(leader, metadata):
    assert wire.StatusError(grpc.StatusCode.UNAVAILABLE, "m", leader=leader).trailing_metadata() == metadata


def test_every_refusal_kind_has_a_code():
    assert set(wire.REFUSAL_CODES) == set(d.Refusal)


def _members(n, hosts=2, step=-1):
    return tuple(d.Member(f"w{i}", f"h{i % hosts}", f"10.0.{i % hosts}.1:{4000 + i}", i, i // hosts,
                          (n + hosts - 1 - i % hosts) // hosts, i % hosts, min(hosts, n), step)
                 for i in range(n))


@pytest.mark.parametrize("members", [
    _members(1, hosts=1),
    _members(5, hosts=2, step=123456789012),
    _members(600, hosts=8),       # over 16 KiB: a three-byte length prefix
], ids=["one", "five", "six-hundred"])
def test_the_spliced_world_is_the_world_each_member_would_be_sent(members):
    action = d.AnnounceWorld(7, members, ())
    got = dict(wire.spliced_worlds(action, {m.worker_id for m in members}))
    assert set(got) == {m.worker_id for m in members}
    for m in members:
        event = pb.WatchEvent.FromString(got[m.worker_id])
        assert event == wire.world_event(7, members, m)
        assert event.world.rank == m.rank and event.world.size == len(members)


def test_the_spliced_world_goes_only_to_members_with_a_stream():
    members = _members(3)
    assert [w for w, _ in wire.spliced_worlds(d.AnnounceWorld(1, members, ()), {"w2", "stranger"})] == ["w2"]


@pytest.mark.parametrize("action, kind", [
    (d.AnnouncePending(3, "worker c joined"), "pending"),
    (d.AnnounceAbort(3, "worker b evicted"), "abort"),
])
def test_notices_go_out_as_their_own_event_kind(action, kind):
    event = wire.notice_event(action)
    assert event.WhichOneof("event") == kind
    assert (getattr(event, kind).world_version, getattr(event, kind).reason) == (3, action.reason)


def _state(**kw):
    base = d.new_job("j", d.JobSpec(1, 2, 60.0), 0.0)
    return dataclasses.replace(base, **kw)


WORLD = _members(2, hosts=1)


@pytest.mark.parametrize("state, worker, kinds, reason", [
    (_state(), "w0", ["standby"], wire.NO_WORLD_YET),
    (_state(version=1, world=WORLD, phase=d.Phase.RUNNING), "spare", ["standby"], wire.HOT_SPARE),
    (_state(version=1, world=WORLD, phase=d.Phase.RUNNING), "w1", ["world"], None),
    (_state(version=1, world=WORLD, phase=d.Phase.RUNNING, aborted_version=1), "w1", ["world", "abort"],
     None),
    (_state(version=1, world=WORLD, phase=d.Phase.SUCCEEDED, reason="worker w0 reported success"), "w1",
     ["finished"], "worker w0 reported success"),
], ids=["no-world", "hot-spare", "member", "member-of-aborted-world", "finished"])
def test_a_reattaching_worker_first_gets_what_the_stored_state_says_of_it(state, worker, kinds, reason):
    events = wire.snapshot(state, worker)
    assert [e.WhichOneof("event") for e in events] == kinds
    first = getattr(events[0], kinds[0])
    if kinds[0] == "world":
        assert first.rank == state.member(worker).rank and first.version == state.version
    else:
        assert first.reason == reason
    if kinds == ["finished"]:
        assert first.succeeded is True


def test_specs_and_members_cross_the_wire_unchanged():
    spec = d.JobSpec(2, 0, 30.5)
    assert wire.spec_from_pb(wire.spec_pb(spec)) == spec
    for m in _members(4, step=2 ** 40):
        assert wire.member_from_pb(wire.member_pb(m)) == m
