"""Table tests of the membership decision: pure function, no sockets, threads or sleeps."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rendezvous.server.decision import (ABORT_ACKS_MAX_WORLD, AbortAck, AnnounceAbort, AnnounceFinished, AnnouncePending, AnnounceWorld,
                                        Attach, DecisionConfig, Dropped, Evict, HostRecord, Join, JobSpec, Leave,
                                        Phase, Progress, Refusal, Rejected, RingBroken, SpecConflict, Success, Tick,
                                        abort_acks_wanted, decide, join_spec, new_job, next_deadline)
from rendezvous.server.job_json import from_json, to_json
from rendezvous.server.server_wire import standby_reason

CFG = DecisionConfig(settle_s=0.2, settle_max_s=2.0, blacklist_after=2, cooldown_min_s=10.0,
                     cooldown_max_s=35.0)


def run(state, events, cfg=CFG):
    """Apply (time, event) pairs; return the final state and all actions, each tagged with its time."""
    out = []
    for t, ev in events:
        state, actions = decide(state, ev, t, cfg)
        out += [(t, a) for a in actions]
    return state, out


def announces(actions):
    return [a for _, a in actions if isinstance(a, AnnounceWorld)]


def ids(announce):
    return [m.worker_id for m in announce.members]


def job(min_np=2, max_np=4, timeout=30.0):
    return new_job("j", JobSpec(min_np, max_np, timeout), 0.0)


def formed(workers, min_np=2, max_np=4, steps=None):
    """A job whose first world holds `workers` = [(id, host)] in order."""
    steps = steps or {}
    evs = [(0.0, Join(w, h, f"{h}:{9000 + i}", steps.get(w, -1), session_hash=f"hash-{w}"))
           for i, (w, h) in enumerate(workers)]
    state, actions = run(job(min_np, max_np), evs + [(1.0, Tick())])
    assert len(announces(actions)) == 1
    return state


def test_world_forms_only_after_settle_window():
    s, acts = run(job(), [(0.0, Join("a", "h1", "h1:1")), (0.05, Join("b", "h1", "h1:2")),
                          (0.2, Tick())])
    assert announces(acts) == []
    assert next_deadline(s, CFG) == pytest.approx(0.25)
    s, acts = run(s, [(0.25, Tick())])
    assert [ids(a) for a in announces(acts)] == [["a", "b"]]
    assert s.world_version == 1 and s.phase is Phase.RUNNING


def test_simultaneous_joins_batch_into_one_world():
    evs = [(0.01 * i, Join(f"w{i}", "h", f"h:{i}")) for i in range(4)]
    s, acts = run(job(), evs + [(0.5, Tick())])
    assert len(announces(acts)) == 1 and s.world_version == 1
    assert ids(announces(acts)[0]) == ["w0", "w1", "w2", "w3"]


def test_settle_max_bounds_wait_under_steady_trickle():
    evs = [(0.15 * i, Join(f"w{i}", "h", f"h:{i}")) for i in range(20)]  # never 0.2 s quiet
    s, acts = run(job(max_np=100), evs)
    assert announces(acts), "a world must form within settle_max_s even if joins keep coming"
    assert acts[0][0] <= CFG.settle_max_s + 0.15


def test_no_world_below_min_np():
    s, acts = run(job(min_np=3), [(0.0, Join("a", "h", "h:1")), (0.0, Join("b", "h", "h:2")),
                                  (5.0, Tick())])
    assert announces(acts) == [] and s.phase is Phase.FORMING


def test_workers_beyond_max_np_are_standby():
    s, acts = run(job(max_np=2), [(0.0, Join(w, "h", f"h:{i}")) for i, w in enumerate("abc")]
                  + [(1.0, Tick())])
    (a,) = announces(acts)
    assert ids(a) == ["a", "b"] and a.standby == ("c",)


def test_standby_joining_full_world_changes_nothing():
    s = formed([("a", "h"), ("b", "h")], max_np=2)
    s, acts = run(s, [(2.0, Join("c", "h", "h:3")), (3.0, Tick())])
    assert acts == [] and s.world_version == 1 and s.standby() == ["c"]


@pytest.mark.parametrize("before, event", [
    ([], Join("c", "h2", "h2:3")),                                       # a spare joins, attached
    ([Join("c", "h2", "h2:3", attached=False)], Attach("c")),           # a spare opens its Watch
], ids=["join", "attach"])
def test_a_spare_for_a_full_world_re_forms_nothing_after_steps_changed_who_would_be_rank_zero(before, event):
    # a was rank 0 at formation; b has committed more since. Ranks are chosen when a world forms.
    s = formed([("a", "h"), ("b", "h")], max_np=2, steps={"a": 5, "b": 5})
    s, _ = run(s, [(1.5, Progress("b", 9))] + [(1.6, e) for e in before])
    s, acts = run(s, [(2.0, event), (3.0, Tick())])
    assert acts == [] and s.world_version == 1
    assert ids(AnnounceWorld(s.world_version, s.world, ())) == ["a", "b"] and s.standby() == ["c"]


def test_hot_spare_replaces_failed_member_without_new_join():
    s = formed([("a", "h1"), ("b", "h2")], max_np=2)
    s, _ = run(s, [(2.0, Join("spare", "h3", "h3:1"))])
    s, acts = run(s, [(3.0, Evict("a", "crashed")), (3.2, Tick())])
    assert [type(a) for _, a in acts if not isinstance(a, type(None))][-1] is AnnounceWorld
    assert [a for _, a in acts if isinstance(a, AnnounceAbort)] == [AnnounceAbort(1, "crashed")]
    assert ids(announces(acts)[0]) == ["b", "spare"] and s.world_version == 2


def test_failure_aborts_old_version_at_once_and_new_world_after_settle():
    s = formed([("a", "h"), ("b", "h"), ("c", "h")])
    s, acts = run(s, [(5.0, Evict("b", "stream broken"))])
    assert ([a for _, a in acts if isinstance(a, (AnnounceAbort, AnnounceWorld))]
            == [AnnounceAbort(1, "stream broken")])
    s, acts = run(s, [(5.1, Tick())])
    assert announces(acts) == []
    s, acts = run(s, [(5.2, Tick())])
    assert ids(announces(acts)[0]) == ["a", "c"]


def test_two_failures_in_one_window_give_one_abort_and_one_world():
    s = formed([("a", "h"), ("b", "h"), ("c", "h"), ("d", "h")])
    s, acts = run(s, [(5.0, Evict("b", "x")), (5.1, Evict("c", "y")), (5.5, Tick())])
    assert len([a for _, a in acts if isinstance(a, AnnounceAbort)]) == 1
    assert [ids(a) for a in announces(acts)] == [["a", "d"]]


def first_world_after_abort(acks, *, evictions=(("b", 5.0),), members="abcd", tick_at=5.05):
    """The first world announced after evicting `evictions` [(id, t)] from a world of `members`,
    with `acks` [(id, t, version)] acknowledging the abort; returns (time, ids) or None by `tick_at`."""
    s = formed([(w, "h") for w in members])
    evs = [(t, Evict(w, "stream broken")) for w, t in evictions] + [(t, AbortAck(w, v)) for w, t, v in acks]
    s, acts = run(s, sorted(evs, key=lambda e: e[0]) + [(tick_at, Tick())])
    worlds = [(t, ids(a)) for t, a in acts if isinstance(a, AnnounceWorld)]
    assert len(worlds) <= 1, worlds
    return worlds[0] if worlds else None


@pytest.mark.parametrize("acks, evictions, expected", [
    # every survivor acknowledged: the world forms at the last acknowledgement, not after the 0.2 s window
    ([("a", 5.01, 1), ("c", 5.02, 1), ("d", 5.03, 1)], (("b", 5.0),), (5.03, ["a", "c", "d"])),
    # one survivor has not (yet): nothing before the window ends
    ([("a", 5.01, 1), ("c", 5.02, 1)], (("b", 5.0),), None),
    # two killed together: the second never acknowledges; its eviction completes the set (one world)
    ([("a", 5.01, 1), ("c", 5.02, 1)], (("b", 5.0), ("d", 5.03)), (5.03, ["a", "c"])),
    # an acknowledgement of another version, or from the evicted worker, counts for nothing
    ([("a", 5.01, 1), ("c", 5.02, 1), ("d", 5.03, 0), ("d", 5.03, 2), ("b", 5.03, 1)], (("b", 5.0),), None),
    # repeated acknowledgements are one
    ([("a", 5.01, 1), ("a", 5.02, 1), ("c", 5.02, 1)], (("b", 5.0),), None),
])
def test_a_world_after_an_abort_forms_once_every_live_member_acknowledged_it(acks, evictions, expected):
    assert first_world_after_abort(acks, evictions=evictions) == expected


@pytest.mark.parametrize("world_size, asked", [(1, True), (2, True), (512, True), (513, False), (4096, False),
                                               (16384, False)])
def test_only_small_worlds_are_asked_to_acknowledge_an_abort(world_size, asked):
    assert abort_acks_wanted(world_size) is asked


def test_the_abort_says_whether_to_acknowledge_it():
    small = formed([(w, "h") for w in "abc"])
    _, acts = run(small, [(5.0, Evict("b", "x"))])
    assert [a.acknowledge for _, a in acts if isinstance(a, AnnounceAbort)] == [True]
    large = formed([(f"w{i}", f"h{i // 8}") for i in range(ABORT_ACKS_MAX_WORLD + 1)],
                   max_np=ABORT_ACKS_MAX_WORLD + 1)
    _, acts = run(large, [(5.0, RingBroken("w0", 1, "timed out"))])
    assert [a.acknowledge for _, a in acts if isinstance(a, AnnounceAbort)] == [False]


def test_without_every_acknowledgement_the_settle_window_still_forms_the_world():
    got = first_world_after_abort([("a", 5.01, 1)], tick_at=5.2)
    assert got == (5.2, ["a", "c", "d"])


def test_an_acknowledgement_before_any_abort_or_from_a_standby_changes_nothing():
    s = formed([("a", "h"), ("b", "h")], max_np=2)
    s, _ = run(s, [(2.0, Join("spare", "h", "h:9")), (2.5, Tick())])
    before = s
    s, acts = run(s, [(3.0, AbortAck("a", 1)), (3.0, AbortAck("spare", 1))])
    assert acts == [] and s == before
    # After an abort, the spare's acknowledgement does not stand in for a member's.
    s, _ = run(s, [(4.0, Evict("b", "x")), (4.01, AbortAck("spare", 1)), (4.02, Tick())])
    assert s.world_version == 1 and s.abort_acks == ()
    s, acts = run(s, [(4.03, AbortAck("a", 1))])
    assert [ids(a) for a in announces(acts)] == [["a", "spare"]] and s.abort_acks == ()


def test_a_ring_broken_report_re_forms_the_same_world_once_everyone_acknowledged():
    s = formed([("a", "h"), ("b", "h")])
    s, acts = run(s, [(2.0, RingBroken("a", 1, "timed out")), (2.01, AbortAck("a", 1)), (2.02, AbortAck("b", 1))])
    assert [(a.world_version, ids(a)) for a in announces(acts)] == [(2, ["a", "b"])]


def test_abort_acknowledgements_round_trip_through_json():
    s = formed([("a", "h"), ("b", "h"), ("c", "h")])
    s, _ = run(s, [(2.0, Evict("c", "x")), (2.01, AbortAck("a", 1))])
    assert s.abort_acks == ("a",) and from_json(to_json(s)) == s


def test_clean_join_and_leave_announce_pending_not_abort():
    s = formed([("a", "h"), ("b", "h")])
    s, acts = run(s, [(2.0, Join("c", "h", "h:3"))])
    assert [a for _, a in acts] == [AnnouncePending(1, "worker c on h joined")]
    s, acts = run(s, [(3.0, Tick())])
    assert ids(announces(acts)[0]) == ["a", "b", "c"]
    s, acts = run(s, [(4.0, Leave("a"))])
    assert not any(isinstance(a, AnnounceAbort) for _, a in acts)
    assert AnnouncePending(2, "worker a left") in [a for _, a in acts]


def test_survivors_keep_relative_order_and_newcomers_are_appended():
    s = formed([("a", "h"), ("b", "h"), ("c", "h"), ("d", "h")], max_np=8)
    s, acts = run(s, [(2.0, Evict("b", "x")), (2.0, Join("e", "h", "h:5")), (3.0, Tick())])
    assert ids(announces(acts)[0]) == ["a", "c", "d", "e"]


def test_highest_commit_step_becomes_rank_zero():
    s = formed([("a", "h"), ("b", "h"), ("c", "h")], steps={"a": 5, "b": 5, "c": 5})
    s, _ = run(s, [(1.5, Progress("c", 9)), (1.5, Progress("b", 3))])  # lower steps are ignored
    s, acts = run(s, [(2.0, Evict("a", "x")), (3.0, Tick())])
    (a,) = announces(acts)
    assert ids(a) == ["c", "b"] and a.members[0].commit_step == 9


def test_ties_in_commit_step_keep_lowest_rank_first():
    s = formed([("a", "h"), ("b", "h"), ("c", "h")], steps={"a": 1, "b": 7, "c": 7})
    assert ids(AnnounceWorld(s.world_version, s.world, ())) == ["b", "a", "c"]


def test_ranks_of_one_host_are_contiguous_with_local_and_cross_ranks():
    s = formed([("a", "h1"), ("b", "h2"), ("c", "h1"), ("d", "h2"), ("e", "h3")], max_np=8)
    layout = [(m.worker_id, m.rank, m.local_rank, m.local_size, m.cross_rank, m.cross_size)
              for m in s.world]
    assert layout == [("a", 0, 0, 2, 0, 3), ("c", 1, 1, 2, 0, 2), ("b", 2, 0, 2, 1, 3),
                      ("d", 3, 1, 2, 1, 2), ("e", 4, 0, 1, 2, 3)]


def test_repeated_failures_blacklist_host_with_exponential_cooldown():
    s = formed([("a", "bad"), ("b", "good")])
    s, _ = run(s, [(2.0, Evict("a", "x")), (2.0, Join("a2", "bad", "bad:2")),
                   (2.1, Evict("a2", "x"))])
    s, acts = run(s, [(3.0, Join("a3", "bad", "bad:3"))])
    assert isinstance(acts[0][1], Rejected) and "blacklisted" in acts[0][1].reason
    assert s.hosts["bad"].blacklisted_until == pytest.approx(2.1 + 10.0)
    s, acts = run(s, [(12.2, Join("a4", "bad", "bad:4"))])  # first cooldown (10 s) over
    assert not any(isinstance(a, Rejected) for _, a in acts)
    s, _ = run(s, [(13.0, Evict("a4", "x")), (13.0, Join("a5", "bad", "bad:5")),
                   (13.0, Evict("a5", "x"))])
    assert s.hosts["bad"].blacklisted_until == pytest.approx(13.0 + 20.0)  # doubled
    s, _ = run(s, [(40.0, Join("a6", "bad", "b:6")), (40.0, Evict("a6", "x")),
                   (40.0, Join("a7", "bad", "b:7")), (40.0, Evict("a7", "x"))])
    assert s.hosts["bad"].blacklisted_until == pytest.approx(40.0 + 35.0)  # capped at max


def test_clean_leaves_do_not_count_toward_blacklist():
    s = formed([("a", "h"), ("b", "h")])
    s, _ = run(s, [(2.0, Leave("a")), (2.0, Join("a", "h", "h:1")), (2.0, Leave("a"))])
    assert s.hosts.get("h") is None or s.hosts["h"].blacklistings == 0


def test_a_stragglers_leave_is_clean_and_puts_its_host_in_the_cooldown_at_once():
    s = formed([("a", "slow"), ("b", "h2"), ("c", "h2")])
    s, acts = run(s, [(2.0, Leave("a", straggler=True))])
    dropped = [a for _, a in acts if isinstance(a, Dropped)]
    assert dropped[0].cause.value == "STRAGGLER" and dropped[0].cause.eviction is None   # no eviction
    assert any(isinstance(a, AnnouncePending) for _, a in acts)                           # not an abort
    assert not any(isinstance(a, AnnounceAbort) for _, a in acts)
    assert s.blacklisted_hosts(2.0) == ["slow"] and s.hosts["slow"].blacklisted_until == pytest.approx(12.0)
    s, acts = run(s, [(2.5, Tick())])
    assert [ids(a) for a in announces(acts)] == [["b", "c"]]
    s, acts = run(s, [(3.0, Join("a-r1", "slow", "slow:2"))])         # nothing of the slow host comes back ...
    assert isinstance(acts[0][1], Rejected) and acts[0][1].kind is Refusal.BLACKLISTED
    s, acts = run(s, [(12.5, Join("a-r1", "slow", "slow:2"))])        # ... until its cooldown ended
    assert not any(isinstance(a, Rejected) for _, a in acts)


def test_a_straggler_on_a_host_that_straggles_again_cools_down_twice_as_long():
    s = formed([("a", "slow"), ("b", "h2"), ("c", "h2")])
    s, _ = run(s, [(2.0, Leave("a", straggler=True)), (3.0, Tick()), (13.0, Join("a2", "slow", "slow:2")),
                   (14.0, Tick()), (20.0, Leave("a2", straggler=True))])
    assert s.hosts["slow"].blacklisted_until == pytest.approx(20.0 + 20.0)


def test_a_spare_on_another_host_takes_the_stragglers_place_but_not_one_on_its_host():
    s, _ = run(job(min_np=2, max_np=2), [(0.0, Join("a", "slow", "s:1")), (0.0, Join("b", "h2", "h2:1")),
                                         (0.0, Join("c", "slow", "s:2")), (0.0, Join("d", "h3", "h3:1")),
                                         (1.0, Tick())])
    assert [m.worker_id for m in s.world] == ["a", "b"]
    s, acts = run(s, [(2.0, Leave("a", straggler=True)), (3.0, Tick())])
    assert [ids(a) for a in announces(acts)] == [["b", "d"]]


def test_a_stragglers_leave_blacklists_nothing_where_the_server_never_blacklists():
    s = formed([("a", "slow"), ("b", "h2")])
    s, _ = run(s, [(2.0, Leave("a", straggler=True))], replace(CFG, blacklist_after=0))
    assert s.blacklisted_hosts(2.0) == []


def test_below_min_np_waits_then_fails_with_reason():
    s = formed([("a", "h"), ("b", "h")], min_np=2)
    s, acts = run(s, [(10.0, Evict("b", "x")), (20.0, Tick())])
    assert s.phase is Phase.WAITING and not any(isinstance(a, AnnounceFinished) for _, a in acts)
    assert next_deadline(s, CFG) == pytest.approx(40.0)
    s, acts = run(s, [(40.0, Tick())])
    (fin,) = [a for _, a in acts if isinstance(a, AnnounceFinished)]
    assert not fin.succeeded and "below min_np=2" in fin.reason and s.phase is Phase.FAILED


def test_recovering_to_min_np_before_timeout_forms_world():
    s = formed([("a", "h"), ("b", "h")], min_np=2)
    s, _ = run(s, [(10.0, Evict("b", "x"))])
    s, acts = run(s, [(15.0, Join("c", "h", "h:3")), (16.0, Tick())])
    assert ids(announces(acts)[0]) == ["a", "c"] and s.phase is Phase.RUNNING


def test_initial_formation_also_bounded_by_elastic_timeout():
    s, acts = run(job(min_np=2, timeout=30.0), [(0.0, Join("a", "h", "h:1")), (30.0, Tick())])
    assert s.phase is Phase.FAILED


def test_success_completes_the_job_once_every_member_returned_at_the_same_commit_and_refuses_joins():
    s = formed([("a", "h"), ("b", "h")])
    s, acts = run(s, [(2.0, Success("b", 1, 40))])
    assert acts == [] and s.phase is Phase.RUNNING   # a alone still trains: one member ends nothing
    s, acts = run(s, [(2.5, Success("a", 1, 40))])
    assert [a for _, a in acts] == [AnnounceFinished(True, "every member of world 1 returned at commit step 40 (a, b)")]
    s, acts = run(s, [(3.0, Join("c", "h", "h:3"))])
    assert acts[0][1].kind is Refusal.FINISHED and s.phase is Phase.SUCCEEDED


@pytest.mark.parametrize("reports, done", [
    ([("a", 1, 40)], False),                                  # one member of three
    ([("a", 1, 40), ("b", 1, 40)], False),                    # a majority is not the world
    ([("a", 1, 40), ("b", 1, 40), ("c", 1, 41)], False),      # c returned at another commit
    ([("a", 1, 40), ("b", 1, 40), ("c", 1, 40)], True),
    ([("a", 1, 30), ("b", 1, 40), ("c", 1, 40), ("a", 1, 40)], True),   # the latest report counts
])
def test_success_needs_every_member_of_the_world_at_the_same_commit_step(reports, done):
    s = formed([("a", "h"), ("b", "h"), ("c", "h")])
    s, _ = run(s, [(2.0 + i, Success(*r)) for i, r in enumerate(reports)])
    assert (s.phase is Phase.SUCCEEDED) is done


def test_a_member_that_left_or_was_evicted_does_not_hold_up_the_others_success():
    s = formed([("a", "h"), ("b", "h"), ("c", "h")])
    s, _ = run(s, [(2.0, Success("a", 1, 7)), (2.1, Leave("c")), (2.2, Success("b", 1, 7))])
    assert s.phase is Phase.SUCCEEDED and "(a, b)" in s.reason


def test_a_success_in_an_earlier_world_does_not_count_in_the_next():
    s = formed([("a", "h"), ("b", "h")], max_np=3)
    s, _ = run(s, [(2.0, Success("a", 1, 5)), (2.5, Join("c", "h", "h:3")), (3.0, Tick())])
    assert s.world_version == 2
    s, _ = run(s, [(4.0, Success("b", 2, 9)), (4.1, Success("c", 2, 9))])
    assert s.phase is Phase.RUNNING   # a returned in world 1 and trains on in world 2 (or leaves)
    s, _ = run(s, [(4.2, Success("a", 2, 9))])
    assert s.phase is Phase.SUCCEEDED


def test_a_joiner_of_a_switch_the_members_never_made_does_not_hold_up_their_success():
    # a and b train to the end in world 1 without a commit, so world 2 (c joining) never forms:
    # their returns in world 1 complete the job; c never trained.
    s = formed([("a", "h"), ("b", "h")], max_np=3)
    s, _ = run(s, [(2.0, Join("c", "h", "h:3")), (3.0, Tick())])
    assert s.world_version == 2 and s.workers["c"].member_since == 2
    s, _ = run(s, [(4.0, Success("a", 1, 0))])
    assert s.phase is Phase.RUNNING   # b still trains
    s, acts = run(s, [(4.1, Success("b", 1, 0))])
    assert s.phase is Phase.SUCCEEDED
    # Once world 2 is what its old members report, every member of it must have returned.
    s = formed([("a", "h"), ("b", "h")], max_np=3)
    s, _ = run(s, [(2.0, Join("c", "h", "h:3")), (3.0, Tick()), (4.0, Success("a", 2, 5)),
                   (4.1, Success("b", 1, 5))])
    assert s.phase is Phase.RUNNING


def test_rejoin_with_its_current_session_replaces_old_membership():
    s = formed([("a", "h"), ("b", "h")])
    s, acts = run(s, [(2.0, Join("b", "h", "h:99", proof="hash-b", session_hash="hash-b2")),
                      (3.0, Tick())])
    assert any(isinstance(a, AnnounceAbort) for _, a in acts)
    assert [m.ring_address for m in announces(acts)[0].members] == ["h:9000", "h:99"]
    assert s.workers["b"].session_hash == "hash-b2"


@pytest.mark.parametrize("proof", ["", "hash-a", "hash-b-guessed"],
                         ids=["no session", "another worker's", "made up"])
def test_join_naming_a_registered_worker_without_its_session_is_refused_and_it_stays(proof):
    s = formed([("a", "h"), ("b", "h")])
    after, acts = run(s, [(2.0, Join("b", "evil", "evil:1", proof=proof, session_hash="mine")),
                          (3.0, Tick())])
    assert [(a.kind, a.worker_id) for _, a in acts] == [(Refusal.WORKER_EXISTS, "b")]
    assert "session_id" in acts[0][1].reason
    assert after.workers == s.workers and after.world == s.world and after.world_version == s.world_version


def test_members_record_the_first_world_they_were_in():
    s = formed([("a", "h"), ("b", "h")])
    s, _ = run(s, [(2.0, Join("c", "h", "h:3")), (3.0, Tick())])
    assert s.world_version == 2
    assert {w: s.workers[w].member_since for w in "abc"} == {"a": 1, "b": 1, "c": 2}


# Success reports: (reporter, world it names, accepted). The job's current world is 2 (a, b since
# 1; c since 2), d is a standby beyond max_np.
@pytest.mark.parametrize("reporter,version,accepted", [
    ("a", 2, True),     # a member of the current world
    ("a", 1, True),     # a member naming an earlier world it was in (it had not seen world 2)
    ("c", 2, True),
    ("c", 1, False),    # c was not in world 1
    ("d", 2, False),    # a standby is in no world
    ("a", 3, False),    # no such world yet
    ("a", 0, False),    # "no world"
    ("zz", 2, False),   # not registered at all
])
def test_success_counts_only_from_a_member_of_the_world_it_names(reporter, version, accepted):
    s = formed([("a", "h"), ("b", "h")], max_np=3)
    s, _ = run(s, [(2.0, Join("c", "h", "h:3")), (3.0, Tick()), (3.5, Join("d", "h", "h:4")),
                   (4.0, Tick())])
    assert s.world_version == 2 and s.standby() == ["d"]
    after, acts = run(s, [(5.0, Success(reporter, version))])
    if accepted:
        assert after.phase is Phase.RUNNING and acts == []   # recorded: the others have not returned
        assert (after.workers[reporter].returned_in, after.workers[reporter].returned_step) == (version, 0)
    else:
        assert after == s
        assert [(type(a), a.kind) for _, a in acts] == [(Rejected, Refusal.NOT_MEMBER)]
        assert f"not a member of world {version}" in acts[0][1].reason


def test_a_refused_rejoin_drops_nobody():
    s = formed([("a", "h"), ("b", "h")])
    _, acts = run(s, [(2.0, Join("a", "h", "h:9", proof=""))])
    assert not [a for _, a in acts if isinstance(a, (Dropped, AnnounceAbort, AnnouncePending))]


def test_invalid_spec_is_refused():
    with pytest.raises(ValueError, match="min_np"):
        new_job("j", JobSpec(3, 2, 1.0), 0.0)


def test_state_round_trips_through_json():
    s = formed([("a", "h1"), ("b", "h2")])
    s, _ = run(s, [(2.0, Evict("a", "x")), (2.0, Join("c", "h1", "h1:5"))])
    assert from_json(to_json(s)) == s
    s, _ = run(s, [(3.0, Success("b", 1, 12))])   # a was evicted: b is the world's last member
    assert s.workers["b"].returned_step == 12 and s.finished_at == 3.0 and from_json(to_json(s)) == s


def test_job_credential_secret_run_and_sessions_round_trip_through_json():
    s = new_job("j", JobSpec(1, 2, 5.0), 0.0, credential="c" * 64, ring_secret="ab" * 32, run="0a1b2c3d")
    s, _ = run(s, [(0.0, Join("a", "h", "h:1", session_hash="5" * 64)), (1.0, Tick())])
    back = from_json(to_json(s))
    assert back == s
    assert (back.credential, back.ring_secret, back.run) == ("c" * 64, "ab" * 32, "0a1b2c3d")
    assert back.workers["a"].session_hash == "5" * 64 and back.workers["a"].member_since == 1


def test_a_state_stored_before_world_version_and_commit_step_had_their_names_still_loads():
    s = formed([("a", "h1"), ("b", "h2")], steps={"a": 7})
    old = json.loads(to_json(s))
    old["version"] = old.pop("world_version")
    for record in old["world"] + list(old["workers"].values()):
        record["committed_step"] = record.pop("commit_step")
    assert from_json(json.dumps(old).encode()) == s


def test_burst_of_joins_into_running_world_sends_one_pending_notice():
    s = formed([("a", "h"), ("b", "h")], max_np=16)
    s, acts = run(s, [(2.0 + 0.01 * i, Join(f"n{i}", "h", f"h:{100 + i}")) for i in range(10)])
    assert ([a for _, a in acts if isinstance(a, AnnouncePending)]
            == [AnnouncePending(1, "worker n0 on h joined")])
    s, acts = run(s, [(3.0, Tick())])
    assert announces(acts)[0].world_version == 2 and len(s.world) == 12
    s, acts = run(s, [(4.0, Join("late", "h", "h:999"))])
    # A new version: notify again.
    assert [a for _, a in acts] == [AnnouncePending(2, "worker late on h joined")]


# ------------------------------------------- pending notices, attaching, blacklisted standbys
def kinds(actions):
    return [f"{type(a).__name__}{getattr(a, 'world_version', '')}" for _, a in actions]


@pytest.mark.parametrize("gone", [Leave("c"), Evict("c", "stream broken")], ids=["leave", "crash"])
def test_pending_notice_is_always_followed_by_a_new_version(gone):
    # A newcomer joins (AnnouncePending(1) goes out) and is gone within the settle window: the members
    # were promised a version > 1, so one comes, with the same members.
    s = formed([("a", "h"), ("b", "h")])
    s, acts = run(s, [(2.0, Join("c", "h", "h:3")), (2.1, gone), (3.0, Tick())])
    assert kinds(acts)[0] == "AnnouncePending1"
    (a,) = announces(acts)
    assert a.world_version == 2 and ids(a) == ["a", "b"] and s.world_version == 2


def test_unattached_worker_stays_out_of_worlds_until_it_attaches():
    s, acts = run(job(min_np=1), [(0.0, Join("a", "h", "h:1")),
                                  (0.0, Join("b", "h", "h:2", attached=False)), (1.0, Tick())])
    assert [ids(a) for a in announces(acts)] == [["a"]]
    s, acts = run(s, [(1.5, Attach("b")), (1.6, Tick()), (1.75, Tick())])
    assert [ids(a) for a in announces(acts)] == [["a", "b"]]
    assert next_deadline(s, CFG) is None


def test_unattached_workers_do_not_count_toward_min_np():
    s, acts = run(job(min_np=2), [(0.0, Join("a", "h", "h:1")),
                                  (0.0, Join("b", "h", "h:2", attached=False)), (5.0, Tick())])
    assert announces(acts) == [] and s.phase is Phase.FORMING


def test_server_caused_eviction_does_not_count_against_the_host():
    s = formed([("a", "h1"), ("b", "h2")])
    s, acts = run(s, [(2.0, Evict("b", "did not reattach", count_failure=False))],
                  replace(CFG, blacklist_after=1))
    assert s.hosts.get("h2") is None and s.blacklisted_hosts(2.0) == []


def test_blacklist_after_zero_never_blacklists():
    s = formed([("a", "h1"), ("b", "h1"), ("c", "h2")])
    s, _ = run(s, [(2.0, Evict("a", "crash")), (3.0, Evict("b", "crash"))], replace(CFG, blacklist_after=0))
    assert s.blacklisted_hosts(3.0) == [] and s.hosts["h1"].failures == 2


# Blacklisted standbys: rows of (what happens, expected world members / phase).
def test_blacklisted_standby_does_not_count_toward_min_np():
    cfg = replace(CFG, blacklist_after=1, cooldown_min_s=10.0, cooldown_max_s=35.0)
    s, _ = run(job(min_np=2, max_np=2, timeout=30.0),
               [(0.0, Join("a", "h1", "h1:1")), (0.0, Join("b", "h2", "h2:1")),
                (0.0, Join("c", "h1", "h1:2")), (1.0, Tick())], cfg)
    assert [m.worker_id for m in s.world] == ["a", "b"] and s.standby() == ["c"]
    s, acts = run(s, [(2.0, Evict("a", "crash")), (3.0, Tick())], cfg)   # h1 blacklisted to 12.0
    assert announces(acts) == [], "a world below min_np must not be announced"
    assert s.phase is Phase.WAITING and s.below_min_since == 2.0


def test_spare_is_promoted_when_its_hosts_cooldown_ends():
    cfg = replace(CFG, blacklist_after=1, cooldown_min_s=10.0, cooldown_max_s=35.0)
    s, _ = run(job(min_np=2, max_np=2, timeout=30.0),
               [(0.0, Join("a", "h1", "h1:1")), (0.0, Join("b", "h2", "h2:1")),
                (0.0, Join("c", "h1", "h1:2")), (1.0, Tick()), (2.0, Evict("a", "crash"))], cfg)
    assert next_deadline(s, cfg) == pytest.approx(12.0)   # the cooldown, before the elastic timeout
    # The change (a's failure) has waited past settle_max already: the world forms at once.
    s, acts = run(s, [(12.0, Tick())], cfg)
    assert [ids(a) for a in announces(acts)] == [["b", "c"]] and s.phase is Phase.RUNNING
    assert next_deadline(s, cfg) is None


@pytest.mark.parametrize("c_attached, expected", [
    (True, 12.0),    # c, on standby, waits on h1's cooldown; a, a member on h1, waits on nothing
    (False, None),   # c has no stream yet: nothing waits on the cooldown
])
def test_the_cooldown_deadline_is_that_of_a_standby_on_a_blacklisted_host(c_attached, expected):
    cfg = replace(CFG, blacklist_after=1, cooldown_min_s=10.0, cooldown_max_s=35.0)
    s, _ = run(job(min_np=1, max_np=3, timeout=30.0),
               [(0.0, Join("a", "h1", "h1:1")), (0.0, Join("y", "h1", "h1:2")), (0.0, Join("b", "h2", "h2:1")),
                (0.0, Join("c", "h1", "h1:3", attached=c_attached)), (1.0, Tick()),
                (2.0, Evict("y", "crash")), (2.5, Tick())], cfg)   # h1 blacklisted until 12
    assert [m.worker_id for m in s.world] == ["a", "b"] and s.standby() == ["c"]
    assert next_deadline(s, cfg) == (pytest.approx(expected) if expected else None)
    assert next_deadline(s, cfg) == _deadline_looking_at_every_worker(s, cfg)


def test_blacklisted_standby_lets_the_elastic_timeout_fire():
    cfg = replace(CFG, blacklist_after=1, cooldown_min_s=100.0, cooldown_max_s=300.0)
    s, _ = run(job(min_np=2, max_np=2, timeout=30.0),
               [(0.0, Join("a", "h1", "h1:1")), (0.0, Join("b", "h2", "h2:1")),
                (0.0, Join("c", "h1", "h1:2")), (1.0, Tick()), (2.0, Evict("a", "crash"))], cfg)
    assert next_deadline(s, cfg) == pytest.approx(32.0)
    s, acts = run(s, [(32.0, Tick())], cfg)
    assert s.phase is Phase.FAILED and "1 eligible worker(s), below min_np=2" in s.reason


@pytest.mark.parametrize("version_delta,reporter,expect_new_world", [
    (0, "a", True),      # a member of the current world: abort it and re-form the same members
    (-1, "a", False),    # a report about an older world changes nothing
    (0, "zz", False),    # a reporter outside the world changes nothing
])
def test_ring_broken_report_aborts_and_reannounces_the_same_members(version_delta, reporter, expect_new_world):
    from rendezvous.server.decision import RingBroken
    state = formed([("a", "h1"), ("b", "h1"), ("c", "h2")])
    v = state.world_version
    state, actions = run(state, [(5.0, RingBroken(reporter, v + version_delta, "timeout on b")), (5.1, Tick()),
                                 (6.0, Tick())])
    aborts = [a for _, a in actions if isinstance(a, AnnounceAbort)]
    new = announces(actions)
    if expect_new_world:
        assert [a.world_version for a in aborts] == [v]
        assert len(new) == 1 and new[0].world_version == v + 1 and ids(new[0]) == ["a", "b", "c"]
    else:
        assert aborts == [] and new == []


@pytest.mark.parametrize("asked, resolved", [
    (JobSpec(), JobSpec(1, 2048, 600.0)),                      # unset: the server's cap and default
    (JobSpec(2, 0, 30.0), JobSpec(2, 2048, 30.0)),
    (JobSpec(2, 8, 0.0), JobSpec(2, 8, 600.0)),
    (JobSpec(2, 8, 30.0), JobSpec(2, 8, 30.0)),                # set: kept
])
def test_a_spec_left_unset_takes_the_servers_cap_and_timeout(asked, resolved):
    assert asked.resolved(2048, 600.0) == resolved


def test_a_job_needs_a_resolved_spec():
    with pytest.raises(ValueError, match="max_np"):
        new_job("j", JobSpec(min_np=2), 0.0)


# ------------------------------------------------------------------ the limits a join gets
@pytest.mark.parametrize("asked, if_new, job_spec, gets", [
    # Creating the job: what the join names, else its defaults for a new job, else the server's (0).
    (JobSpec(2, 8, 30.0), JobSpec(1, 1024, 0.0), None, JobSpec(2, 8, 30.0)),
    (JobSpec(0, 0, 0.0), JobSpec(4, 1024, 0.0), None, JobSpec(4, 1024, 0.0)),
    (JobSpec(3, 0, 0.0), JobSpec(1, 16, 60.0), None, JobSpec(3, 16, 60.0)),
    (JobSpec(0, 0, 0.0), JobSpec(0, 0, 0.0), None, JobSpec(0, 0, 0.0)),
    # Into a running job: a limit left 0 is the job's, whatever this join would create a job with.
    (JobSpec(0, 0, 0.0), JobSpec(1, 1024, 0.0), JobSpec(2, 1024, 600.0), JobSpec(2, 1024, 600.0)),
    (JobSpec(2, 0, 0.0), JobSpec(1, 1024, 0.0), JobSpec(2, 1024, 600.0), JobSpec(2, 1024, 600.0)),
    (JobSpec(0, 1024, 0.0), JobSpec(5, 5, 0.0), JobSpec(2, 1024, 600.0), JobSpec(2, 1024, 600.0)),
    (JobSpec(2, 1024, 5.0), JobSpec(1, 1024, 0.0), JobSpec(2, 1024, 600.0), JobSpec(2, 1024, 600.0)),
])
def test_a_join_takes_the_job_limits_it_leaves_unset_and_creates_a_job_with_its_own(asked, if_new, job_spec,
                                                                                      gets):
    assert join_spec("exp7", asked, if_new, job_spec) == gets


@pytest.mark.parametrize("asked, named", [
    (JobSpec(1, 0, 0.0), "min_np=1"),
    (JobSpec(0, 8, 0.0), "max_np=8"),
    (JobSpec(3, 8, 0.0), "min_np=3, max_np=8"),
])
def test_a_join_naming_other_limits_than_the_running_job_is_refused(asked, named):
    got = join_spec("exp7", asked, JobSpec(1, 1024, 0.0), JobSpec(2, 1024, 600.0))
    assert got == SpecConflict(f"job exp7 has min_np=2 max_np=1024; this join asks for {named} (leave a "
                               f"limit unset to take the job's)")


# ------------------------------------------------------------------ what a standby worker is told
def test_a_standby_worker_is_told_what_it_waits_for():
    s = formed([("a", "h1"), ("b", "h1")], min_np=1, max_np=4)
    s, _ = run(s, [(2.0, Join("c", "h2", "h2:1"))])
    assert standby_reason(s, "c", 2.0) == "joins world 2 at the next commit of world 1 (2 of max_np=4 in it)"
    full = formed([("a", "h1"), ("b", "h1")], min_np=1, max_np=2)
    full, _ = run(full, [(2.0, Join("c", "h2", "h2:1"))])
    assert standby_reason(full, "c", 2.0) == ("beyond max_np=2: a hot spare, it takes the place of the next "
                                              "member that fails or leaves")
    assert standby_reason(job(), "a", 0.0) == "no world formed yet"
    cooling = replace(s, hosts={**s.hosts, "h2": HostRecord(blacklistings=1, blacklisted_until=32.0)})
    assert standby_reason(cooling, "c", 2.0) == "host h2 is blacklisted for 30 s more after repeated failures or a straggler"


def test_the_counts_a_state_carries_are_those_counted_afresh():
    # eligible_count and abort_acknowledged are carried from state to state (O(1) an event);
    # after any mix of events they equal a count from scratch (a copy of the state caches nothing).
    import dataclasses
    import random

    from rendezvous.server import decision as d
    rnd = random.Random(7)
    seen = set()
    state = d.new_job("j", JobSpec(2, 12, 60.0), 0.0)
    now = 0.0
    for step in range(600):
        now += rnd.choice([0.01, 0.3, 2.0])
        wid = f"w{rnd.randrange(16)}"
        kind = rnd.choice([0, 0, 1, 1, 1, 2, 3, 4, 5, 6, 6, 6, 7])
        member = state.member(wid)
        if kind == 0:
            ev = d.Join(wid, f"h{rnd.randrange(8)}", f"10.0.0.1:{rnd.randrange(9000, 9100)}", attached=False,
                        session_hash="s", proof="s")
        elif kind == 1:
            ev = d.Attach(wid)
        elif kind == 2:
            ev = d.Evict(wid, "gone", count_failure=rnd.random() < 0.5)   # counted: host records change
        elif kind == 3:
            ev = d.Leave(wid, straggler=rnd.random() < 0.2)   # a straggler cools its host down
        elif kind == 4:
            ev = d.Progress(wid, step)
        elif kind == 5 and member is not None:
            ev = d.RingBroken(wid, state.world_version, "peer lost")
        elif kind == 6 and member is not None:
            ev = d.AbortAck(wid, state.world_version)
            for m in state.world[:-1] if rnd.random() < 0.5 else ():   # most of the world acknowledges at once
                state, acts = d.decide(state, d.AbortAck(m.worker_id, state.world_version), now, CFG)
                assert d.abort_acknowledged(state) == d.abort_acknowledged(dataclasses.replace(state))
                if any(isinstance(a, d.AnnounceWorld) for a in acts):
                    seen.add("formed once every member acknowledged")
        else:
            ev = d.Tick()
        state, acts = d.decide(state, ev, now, CFG)
        if isinstance(ev, d.AbortAck) and any(isinstance(a, d.AnnounceWorld) for a in acts):
            seen.add("formed once every member acknowledged")
        fresh = dataclasses.replace(state)
        assert d.eligible_count(state, now) == d.eligible_count(fresh, now), (step, ev)
        assert d.abort_acknowledged(state) == d.abort_acknowledged(fresh), (step, ev)
        assert d.next_deadline(state, CFG) == _deadline_looking_at_every_worker(state, CFG), (step, ev)
        seen.add(len(state.world) > 1)
    assert seen == {False, True, "formed once every member acknowledged"}


def _deadline_looking_at_every_worker(state, cfg):
    """next_deadline as its definition says it, every registered worker looked at."""
    from rendezvous.server import decision as d
    if state.phase in d.TERMINAL:
        return None
    times = []
    if state.change_last is not None and d.eligible_count(state) >= state.spec.min_np:
        times.append(min(state.change_last + cfg.settle_s, state.change_first + cfg.settle_max_s))
    if state.below_min_since is not None:
        times.append(state.below_min_since + state.spec.elastic_timeout_s)
    times += [state.hosts[w.host].blacklisted_until for w in state.workers.values()
              if w.host in state.hosts and state.hosts[w.host].blacklisted_until and w.attached
              and not state.in_world(w.worker_id)]
    return min(times) if times else None
