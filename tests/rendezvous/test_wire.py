"""Table tests of the wire forms: pure functions, no sockets. What a refusal's metadata says and what a
(re)attaching worker is sent first (each member's view of a world: tests/rendezvous/test_world_views.py)."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from rendezvous.server import decision as d
from rendezvous.server import server_wire
from rendezvous.server.world_views import WorldViews
from rendezvous.wire import messages as wire
from rendezvous.wire.messages import pb

OUTCOME = wire.JOB_OUTCOME_KEY


@pytest.mark.parametrize("metadata, finished", [
    ((), None),
    (None, None),
    (((OUTCOME, "succeeded"),), True),
    (((OUTCOME, "failed"),), False),
    ((("leader", "10.0.0.1:29400"), (OUTCOME, "failed")), False),
    (((OUTCOME, "SUCCEEDED"),), None),          # only the exact words count
    (((OUTCOME, "succeeded "),), None),
    (((OUTCOME, "yes"),), None),
    (((OUTCOME, b"succeeded"),), None),         # not a text value
    ((("elastic-job-outcome-bin", b"succeeded"),), None),
    ((("grpc-message", "job j finished (SUCCEEDED: worker w reported success)"),), None),
])
def test_the_job_outcome_is_read_from_its_metadata_key_only(metadata, finished):
    assert wire.job_outcome(metadata) is finished


@pytest.mark.parametrize("leader, finished, metadata", [
    ("", None, ()),
    ("10.0.0.1:29400", None, (("leader", "10.0.0.1:29400"),)),
    ("", True, ((OUTCOME, "succeeded"),)),
    ("", False, ((OUTCOME, "failed"),)),
])
def test_a_status_error_carries_its_hint_and_outcome_as_trailing_metadata(leader, finished, metadata):
    e = server_wire.RpcRefusal(grpc.StatusCode.UNAVAILABLE, "m", leader=leader, finished=finished)
    assert e.trailing_metadata() == metadata
    assert wire.job_outcome(metadata) is finished and wire.leader_hint(metadata) == leader


@pytest.mark.parametrize("kind, phase, code, finished", [
    (d.Refusal.FINISHED, d.Phase.SUCCEEDED, grpc.StatusCode.FAILED_PRECONDITION, True),
    (d.Refusal.FINISHED, d.Phase.FAILED, grpc.StatusCode.FAILED_PRECONDITION, False),
    (d.Refusal.BLACKLISTED, d.Phase.RUNNING, grpc.StatusCode.FAILED_PRECONDITION, None),
    (d.Refusal.WORKER_EXISTS, d.Phase.RUNNING, grpc.StatusCode.ALREADY_EXISTS, None),
    (d.Refusal.NOT_MEMBER, d.Phase.RUNNING, grpc.StatusCode.PERMISSION_DENIED, None),
])
def test_a_refusal_gets_its_code_from_its_kind_and_an_outcome_only_when_the_job_is_over(
        kind, phase, code, finished):
    e = server_wire.refusal(d.Rejected("w", "why", kind), "job j: why", phase)
    assert (e.code, e.finished, e.message) == (code, finished, "job j: why")


def test_every_refusal_kind_has_a_code():
    assert set(server_wire.REFUSAL_CODES) == set(d.Refusal)


@pytest.mark.parametrize("action, kind", [
    (d.AnnouncePending(3, "worker c joined"), "pending"),
    (d.AnnounceAbort(3, "worker b evicted"), "abort"),
])
def test_notices_go_out_as_their_own_event_kind(action, kind):
    event = server_wire.notice_event(action)
    assert event.WhichOneof("event") == kind
    assert (getattr(event, kind).world_version, getattr(event, kind).reason) == (3, action.reason)


@pytest.mark.parametrize("acknowledge", [True, False])
def test_an_abort_says_whether_to_acknowledge_it(acknowledge):
    event = server_wire.notice_event(d.AnnounceAbort(3, "worker b evicted", acknowledge))
    assert event.abort.acknowledge is acknowledge


def _state(**kw):
    base = d.new_job("j", d.JobSpec(1, 2, 60.0), 0.0)
    return dataclasses.replace(base, **kw)


def _members(n, hosts=2, step=-1):
    """n members on `hosts` hosts, each host's ranks contiguous (as decision.compute_world makes them)."""
    per = -(-n // hosts)
    return tuple(d.Member(f"w{i}", f"h{i // per}", f"10.0.{i // per}.1:{4000 + i}", i, i % per,
                          min(per, n - i // per * per), i // per, -(-n // per), step) for i in range(n))


WORLD = _members(2, hosts=1)


@pytest.mark.parametrize("state, worker, kinds, reason", [
    (_state(), "w0", ["standby"], server_wire.NO_WORLD_YET),
    (_state(world_version=1, world=WORLD, phase=d.Phase.RUNNING), "spare", ["standby"],
     "beyond max_np=2: a hot spare, it takes the place of the next member that fails or leaves"),
    (_state(world_version=1, world=WORLD, phase=d.Phase.RUNNING), "w1", ["world"], None),
    (_state(world_version=1, world=WORLD, phase=d.Phase.RUNNING, aborted_version=1), "w1", ["world", "abort"],
     None),
    (_state(world_version=1, world=WORLD, phase=d.Phase.SUCCEEDED, reason="worker w0 reported success"), "w1",
     ["finished"], "worker w0 reported success"),
], ids=["no-world", "hot-spare", "member", "member-of-aborted-world", "finished"])
def test_a_reattaching_worker_first_gets_what_the_stored_state_says_of_it(state, worker, kinds, reason):
    events = server_wire.snapshot(state, WorldViews(state.world_version, state.world), worker, 0.0)
    assert [e.WhichOneof("event") for e in events] == kinds
    first = getattr(events[0], kinds[0])
    if kinds[0] == "world":
        assert first.rank == state.member(worker).rank and first.world_version == state.world_version
    else:
        assert first.reason == reason
    if kinds == ["finished"]:
        assert first.succeeded is True
    if "abort" in kinds:   # a world of 2 is asked to acknowledge, as its live abort did
        assert events[-1].abort.acknowledge is True and events[-1].abort.world_version == 1


@pytest.mark.parametrize("size", [d.ABORT_ACKS_MAX_WORLD, d.ABORT_ACKS_MAX_WORLD + 1])
def test_a_reattaching_member_of_an_aborted_world_is_asked_to_acknowledge_as_the_world_was(size):
    world = _members(size, hosts=size // 8)
    state = _state(world_version=1, world=world, phase=d.Phase.RUNNING, aborted_version=1)
    events = server_wire.snapshot(state, WorldViews(1, world), "w1", 0.0)
    assert events[-1].abort.acknowledge is d.abort_acks_wanted(size) is (size <= d.ABORT_ACKS_MAX_WORLD)


def test_specs_and_members_cross_the_wire_unchanged():
    spec = d.JobSpec(2, 0, 30.5)
    assert wire.spec_from_pb(wire.spec_pb(spec)) == spec
    for m in _members(4, step=2 ** 40):
        assert wire.member_from_pb(wire.member_pb(m)) == m
