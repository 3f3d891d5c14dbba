"""The worker's reactions to rendezvous events, as rules (elastic/runtime/reaction.py)."""

import pytest

from elastic.ring.errors import (BadPeerError, CollectiveMismatchError, HandshakeError, SettingsMismatchError,
                                 WorkerLostError)
from elastic.runtime.errors import ElasticTimeout, MembershipChanged
from elastic.runtime.reaction import (AbortRing, Note, Recovery, StateAction, View, aborted_while_forming,
                                      after_error, after_mismatch, holding, membership_pending, must_form, react,
                                      rejoined, superseded, world_moved_on, world_to_take)
from rendezvous.client.watch_events import Abort, Ended, Finished, Pending, Standby, WorldInfo
from rendezvous.wire.membership import Member


def world(version, *ids, me="w0"):
    """World `version` of members `ids` as `me` is told it (small: every member is a ring neighbour)."""
    import hashlib
    members = tuple(Member(worker_id=w, host="h", ring_address=f"127.0.0.1:{9000 + i}", rank=i,
                               local_rank=i, local_size=len(ids), cross_rank=0, cross_size=1, commit_step=-1)
                    for i, w in enumerate(ids))
    rank = ids.index(me)
    return WorldInfo(world_version=version, peers=members, rank=rank, size=len(ids), local_rank=rank,
                     local_size=len(ids), cross_rank=0, cross_size=1,
                     digest=hashlib.sha256(",".join(ids).encode()).digest())


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
    assert view.latest.world_version == 3 and view.seen_version == 4
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


def test_finished_while_forming_aborts_the_forming_ring_either_way():
    # A joiner forming the next world waits for members that finished their run instead: it stops.
    _, actions = react(in_ring(3, formed=False), Finished(True, "w1 reported success"))
    assert aborts(actions) == [AbortRing("job finished while world version 3 formed: w1 reported success")]
    view, actions = react(in_ring(3, formed=False), Finished(False, "below min_np for 600 s"))
    assert aborts(actions) == [AbortRing("job failed: below min_np for 600 s")]
    assert view.finished == Finished(False, "below min_np for 600 s")


def test_success_keeps_a_formed_ring_for_the_collectives_after_the_run():
    view, actions = react(in_ring(3), Finished(True, "w1 reported success"))
    assert aborts(actions) == [] and view.finished.succeeded


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
    assert world_to_take(view, min_version).world_version == 4


def test_no_ring_means_nothing_pending():
    view, _ = react(View(), Pending(1, "w1 joined"))
    assert not membership_pending(view)



# ---------------------------------------------------------------------- the loop's rules
KEEP, KEEP_LIVE, RESTORE = StateAction.KEEP, StateAction.KEEP_LIVE, StateAction.RESTORE


@pytest.mark.parametrize("error, held, recovery", [
    # a lost peer: restore, report, and take a world newer than both the ring held and the error's
    (WorkerLostError("peer 1 closed", world_version=4), 4, Recovery(5, RESTORE, report=True, stale=False)),
    (WorkerLostError("aborted: a newer world failed", world_version=6), 4,
     Recovery(7, RESTORE, report=True, stale=False)),
    (WorkerLostError("from an older ring", world_version=2), 4, Recovery(5, RESTORE, report=True, stale=False)),
    (WorkerLostError("while forming the first ring", world_version=1), 0,
     Recovery(2, RESTORE, report=True, stale=False)),
    # an unusable neighbour address is a lost peer too, reported so the server evicts it
    (BadPeerError("rank 1 does not prove the secret", world_version=3, peer=1), 3,
     Recovery(4, RESTORE, report=True, stale=False)),
    # a neighbour at another world version: ours is stale; nobody to report
    (HandshakeError("rank 1 is at world version 5", world_version=4), 4,
     Recovery(5, RESTORE, report=False, stale=True)),
    (HandshakeError("before any ring", world_version=1), 0, Recovery(1, RESTORE, report=False, stale=True)),
    # a clean join or leave keeps the state
    (MembershipChanged("w2 joined"), 4, Recovery(5, KEEP, report=False, stale=False)),
])
def test_after_each_error_the_next_world_and_the_state(error, held, recovery):
    assert after_error(error, held, live_state_usable=False) == recovery


@pytest.mark.parametrize("error, held, action", [
    (WorkerLostError("peer 1 closed", world_version=4), 4, KEEP_LIVE),
    (HandshakeError("rank 1 is at world version 5", world_version=4), 4, KEEP_LIVE),
    # nothing failed: the state is kept whatever the step's phase
    (MembershipChanged("w2 joined"), 4, KEEP),
])
def test_a_failure_before_the_optimizer_changed_anything_keeps_the_live_state(error, held, action):
    assert after_error(error, held, live_state_usable=True).state is action


@pytest.mark.parametrize("error", [SettingsMismatchError("ring settings differ", setting="algorithm"),
                                   ElasticTimeout("no world"), ValueError("a bug in the training function")])
def test_an_error_no_later_world_fixes_is_not_the_loops_to_handle(error):
    assert after_error(error, 4, live_state_usable=True) is None


@pytest.mark.parametrize("ring_world_version, failed, min_version, form", [
    (0, False, 1, True),     # no ring yet
    (3, True, 3, True),      # the ring held failed
    (3, False, 4, True),     # the ring held is older than the world to take
    (3, False, 3, False),    # a kept ring after a sync refused nothing: sync again on it
    (5, False, 4, False),    # a ring newer than needed is kept
])
def test_a_ring_is_formed_only_when_none_usable_is_held(ring_world_version, failed, min_version, form):
    assert must_form(ring_world_version, failed, min_version) is form


@pytest.mark.parametrize("aborted, version, dead", [(-1, 3, False), (2, 3, False), (3, 3, True), (4, 3, True)])
def test_a_ring_that_connected_after_its_world_was_aborted_fails_at_once(aborted, version, dead):
    view = holding(View(aborted_version=aborted), version, formed=True)
    assert aborted_while_forming(view, version) is dead


@pytest.mark.parametrize("view, moved_on", [
    (View(), False),
    (View(pending_version=3, aborted_version=2, seen_version=3), False),   # older news only
    (View(pending_version=4), True),      # a member of world 4 left it cleanly
    (View(aborted_version=4), True),      # one failed
    (View(seen_version=5), True),         # a newer world exists
    (View(seen_version=4), False),        # world 4 itself
])
def test_the_world_moved_on_when_the_server_announced_its_end(view, moved_on):
    assert world_moved_on(view, 4) is moved_on


MISMATCH = CollectiveMismatchError("rank 2 is in a different collective", op="allreduce", world_version=4)


@pytest.mark.parametrize("usable, action", [(True, StateAction.KEEP_LIVE), (False, StateAction.RESTORE)])
def test_a_mismatch_the_server_explains_re_forms_the_world_like_a_failure_without_a_report(usable, action):
    assert after_mismatch(MISMATCH, 4, usable, moved_on=True) == Recovery(5, action, report=False, stale=False)


@pytest.mark.parametrize("usable, action", [(True, StateAction.KEEP_LIVE), (False, StateAction.RESTORE)])
def test_a_mismatch_nobody_left_over_re_forms_the_world_and_reports_the_sender(usable, action):
    # Its members compare what they called at the next sync (elastic.runtime.divergence).
    assert after_mismatch(MISMATCH, 4, usable, moved_on=False) == Recovery(5, action, report=True, stale=False)


@pytest.mark.parametrize("outvoted", [True, False])
def test_the_worlds_verdict_on_a_mismatch_ends_the_worker(outvoted):
    decided = CollectiveMismatchError("verdict", op="check_divergence", world_version=5, decided=True,
                                      outvoted=outvoted)
    assert after_mismatch(decided, 5, True, moved_on=False) is None
    assert after_mismatch(decided, 5, True, moved_on=True) is None
