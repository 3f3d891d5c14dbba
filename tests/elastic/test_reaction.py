"""The worker's reactions to rendezvous events, as rules (elastic/reaction.py)."""

from elastic.reaction import (AbortRing, Note, View, holding, membership_pending, react, rejoined, superseded,
                              world_to_take)
from rendezvous.watch_events import Abort, Ended, Finished, Pending, Standby, WorldInfo
from rendezvous.membership import Member


def world(version, *ids, me="w0"):
    members = tuple(Member(worker_id=w, host="h", ring_address=f"127.0.0.1:{9000 + i}", rank=i,
                               local_rank=i, local_size=len(ids), cross_rank=0, cross_size=1, committed_step=-1)
                    for i, w in enumerate(ids))
    rank = ids.index(me)
    return WorldInfo(version=version, members=members, rank=rank, size=len(ids), local_rank=rank,
                     local_size=len(ids), cross_rank=0, cross_size=1)


def aborts(actions):
    return [a for a in actions if isinstance(a, AbortRing)]


def in_ring(version, formed=True, **kw):
    """A worker holding the ring of world `version`, which it took from that world's announcement."""
    return holding(View(latest=world(version, "w0", "w1"), seen_version=version, **kw), version, formed)


def test_abort_for_the_current_version_aborts_the_ring():
    view, actions = react(in_ring(3), Abort(3, "w1 evicted"))
    assert aborts(actions) == [AbortRing("rendezvous: w1 evicted")]
    assert view.aborted_version == 3


def test_abort_for_an_older_version_leaves_the_ring_alone():
    view, actions = react(in_ring(3), Abort(2, "w9 evicted"))
    assert aborts(actions) == []
    assert view.aborted_version == 2


def test_abort_for_a_newer_version_aborts_a_ring_not_waiting_to_switch():
    _, actions = react(in_ring(3), Abort(4, "w1 evicted"))
    assert len(aborts(actions)) == 1


def test_abort_of_the_next_world_spares_a_ring_waiting_to_switch_at_its_commit():
    view, _ = react(in_ring(3), Pending(3, "w2 joined"))
    view, actions = react(view, Abort(4, "w2 evicted"))
    assert aborts(actions) == []


def test_abort_with_no_ring_only_records_the_version():
    view, actions = react(View(), Abort(5, "w1 evicted"))
    assert actions == () and view.aborted_version == 5
    assert superseded(view, 5) and not superseded(view, 6)


def test_a_world_that_excludes_this_worker_is_standby_and_keeps_the_ring_until_its_commit():
    view, _ = react(in_ring(3), Pending(3, "w0 beyond max_np"))
    view, actions = react(view, Standby(4, "beyond max_np"))
    assert aborts(actions) == [] and any(isinstance(a, Note) for a in actions)
    assert view.latest.version == 3 and view.seen_version == 4
    assert membership_pending(view)
    assert world_to_take(view, 4) is None


def test_pending_then_world_switches_at_the_commit_boundary_only():
    view, actions = react(in_ring(3), Pending(3, "w2 joined"))
    assert actions == () and membership_pending(view)
    new = world(4, "w0", "w1", "w2")
    view, actions = react(view, new)
    assert aborts(actions) == []          # a formed ring runs on until its next commit
    assert world_to_take(view, 4) == new


def test_a_newer_world_aborts_a_ring_still_forming():
    view, actions = react(in_ring(3, formed=False), world(4, "w0"))
    assert aborts(actions) == [AbortRing("world version 3 superseded by 4 while forming")]


def test_finished_while_forming_aborts_only_when_the_job_failed():
    _, actions = react(in_ring(3, formed=False), Finished(True, "w1 reported success"))
    assert aborts(actions) == []
    view, actions = react(in_ring(3, formed=False), Finished(False, "below min_np for 600 s"))
    assert aborts(actions) == [AbortRing("job failed: below min_np for 600 s")]
    assert view.finished == Finished(False, "below min_np for 600 s")


def test_finished_before_any_ring_is_recorded_for_the_wait():
    view, actions = react(View(), Finished(True, "done"))
    assert actions == () and view.finished.succeeded


def test_reattach_after_a_server_restart_resends_the_world_and_changes_nothing():
    before = in_ring(3)
    view, actions = react(before, world(3, "w0", "w1"))
    assert actions == () and view == before
    assert not membership_pending(view)


def test_same_version_with_other_members_is_a_new_world():
    view, _ = react(in_ring(3), world(3, "w1", "w0", me="w0"))
    assert view.latest.rank == 1
    assert world_to_take(view, 3).rank == 1


def test_an_ended_session_aborts_the_ring_and_rejoining_takes_only_newer_worlds():
    view, actions = react(in_ring(3), Ended("NOT_FOUND: unknown session"))
    assert aborts(actions) == [AbortRing("rendezvous session ended: NOT_FOUND: unknown session")]
    view, min_version = rejoined(view)
    assert min_version == 4 and view.ended is None and view.latest is None
    view, _ = react(view, world(3, "w0", "w1"))
    assert world_to_take(view, min_version) is None
    view, _ = react(view, world(4, "w0", "w1"))
    assert world_to_take(view, min_version).version == 4


def test_no_ring_means_nothing_pending():
    view, _ = react(View(), Pending(1, "w1 joined"))
    assert not membership_pending(view)
