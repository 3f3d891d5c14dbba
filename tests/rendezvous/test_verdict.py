"""Table tests of the failure-report judgement: pure function, no sockets, futures, clocks or waits."""
from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous.server import decision as d
from rendezvous.server.verdict import (CORROBORATION_HEARTBEATS, PROBE_SLACK_S, AwaitCorroboration, AwaitProbe,
                                       AwaitReattach, Dismiss, Evict, Gone, Heard, Inquiry, Probe, Refuse, Report,
                                       RingBroken, SuspectStream, corroborated, judge_report)
from rendezvous.wire.membership import Blame

from .fakes import CONFIG, running

HEARTBEAT_TIMEOUT_S = 2.0
NOW = 100.0
WORLD = running(["a", "b", "c"])           # world 1: a, b, c at ranks 0, 1, 2
OPEN = SuspectStream(open=True)
LOST = SuspectStream(open=False)            # it had a stream under this leader, and lost it
AWAITED = SuspectStream(open=False, awaited=True)   # none since this replica began leading
ANSWERED = SuspectStream(open=True, probe_answered=True)


def report(**kw) -> Report:
    return Report(**{"reporter": "a", "suspect": "b", "world_version": 1, "reason": "connection reset", **kw})


def fresh(reattach_until: float = NOW - 1.0) -> Inquiry:
    """A report that just arrived; by default this replica has led for longer than the window."""
    return Inquiry(reattach_until=reattach_until, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)


def admitted(state=WORLD, **kw) -> Inquiry:
    return replace(fresh(), suspect_seq=state.workers["b"].join_seq, reporter_seq=state.workers["a"].join_seq, **kw)


def probed(deadline: float = NOW + 1.0, state=WORLD) -> Inquiry:
    return admitted(state, probe_deadline=deadline)


def judge(stream=OPEN, rep=None, inquiry=None, state=WORLD, now=NOW, heard=None):
    """`heard`: the other reports about the suspect, as (reporter, blame); this one is added."""
    rep = rep or report()
    heard = Heard(((rep.reporter, rep.blame), *(heard or ())))
    return judge_report(state, stream, rep, heard, inquiry or fresh(), now)


def verdict(**kw):
    return judge(**kw)[1]


# ------------------------------------------------------------------------------------ admission
def test_a_report_about_another_world_is_dismissed_as_stale():
    assert verdict(rep=report(world_version=7)) == Dismiss("stale report: world 7 is not the current world 1")


def test_a_reporter_outside_the_world_is_refused():
    state, _ = d.decide(WORLD, d.Join("x", "h9", "10.0.0.9:9000"), 2.0, CONFIG)   # standby
    assert isinstance(verdict(rep=report(reporter="x"), state=state), Refuse)


@pytest.mark.parametrize("suspect, state", [
    ("nobody", WORLD),
    ("x", d.decide(WORLD, d.Join("x", "h9", "10.0.0.9:9000"), 2.0, CONFIG)[0]),
], ids=["unknown", "standby"])
def test_a_suspect_outside_the_world_is_dismissed(suspect, state):
    v = verdict(rep=report(suspect=suspect), state=state)
    assert isinstance(v, Dismiss) and "is not a member of world 1" in v.detail


def test_an_admitted_report_remembers_which_session_of_the_suspect_it_is_about():
    inquiry, _ = judge()
    assert inquiry.suspect_seq == WORLD.workers["b"].join_seq


def test_admission_is_judged_once_so_a_world_formed_meanwhile_does_not_make_the_report_stale():
    later = replace(WORLD, world_version=2)
    assert isinstance(verdict(inquiry=admitted(), state=later), Probe)


# ---------------------------------------------------------------------------- without a stream
def test_a_suspect_not_reattached_since_leadership_began_gets_the_heartbeat_timeout_since_then():
    assert verdict(stream=AWAITED, inquiry=fresh(reattach_until=NOW + 1.5)) == AwaitReattach(NOW + 1.5)


def test_a_suspect_not_reattached_by_then_is_evicted_but_not_counted_against_its_host():
    v = verdict(stream=AWAITED, inquiry=fresh(reattach_until=NOW))
    assert isinstance(v, Evict) and (v.cause, v.count_failure) == (d.Departure.REPORTED, False)


def test_a_suspect_that_lost_its_stream_under_this_leader_is_evicted_and_counted():
    v = verdict(stream=LOST, inquiry=fresh(reattach_until=NOW + 1.5))
    assert v == Evict("no watch stream; reported by a: connection reset", d.Departure.REPORTED, True,
                      "suspect had no watch stream")


def test_a_suspect_that_went_away_while_awaited_is_answered_as_evicted():
    gone = replace(WORLD, workers={w: x for w, x in WORLD.workers.items() if w != "b"})
    assert verdict(stream=LOST, inquiry=admitted(), state=gone) == Gone("suspect gone meanwhile")


def test_a_suspect_that_joined_again_is_another_session_and_the_report_is_answered_as_evicted():
    rejoined = replace(WORLD, workers={**WORLD.workers, "b": replace(WORLD.workers["b"], join_seq=99)})
    assert verdict(inquiry=admitted(), state=rejoined) == Gone("suspect gone meanwhile")


# ------------------------------------------------------------------------------- accusations
def test_an_accusation_no_other_member_joined_waits_for_them_even_while_the_suspect_is_alive():
    inquiry, v = judge(rep=report(blame=Blame.UNUSABLE))
    until = NOW + CORROBORATION_HEARTBEATS * HEARTBEAT_TIMEOUT_S + PROBE_SLACK_S
    assert v == AwaitCorroboration(until) and inquiry.corroboration_deadline == until


@pytest.mark.parametrize("blame, cause", [
    (Blame.UNUSABLE, d.Departure.UNUSABLE_ADDRESS),
    (Blame.IMPOSSIBLE_ROW, d.Departure.BLAMED),
    (Blame.FALSE_LEAVE, d.Departure.BLAMED),
    (Blame.DIVERGED, d.Departure.DIVERGED),
])
def test_an_accusation_the_majority_of_the_others_made_evicts_the_suspect_even_while_its_stream_is_open(blame, cause):
    v = verdict(rep=report(blame=blame), heard=[("c", blame)])
    assert isinstance(v, Evict) and (v.cause, v.count_failure) == (cause, True)
    assert "reported by 2 of the 2 other member(s) of world 1: a, c);" in v.reason


def test_a_failure_report_of_another_member_corroborates_an_accusation():
    # The suspect never connected: its predecessor finds its address unusable, its successor waited for it.
    v = verdict(rep=report(blame=Blame.UNUSABLE), heard=[("c", Blame.NONE)])
    assert isinstance(v, Evict) and v.cause is d.Departure.UNUSABLE_ADDRESS


def test_the_failure_report_that_completes_a_majority_evicts_too():
    v = verdict(rep=report(reporter="c"), heard=[("a", Blame.DIVERGED)])
    assert isinstance(v, Evict) and v.cause is d.Departure.DIVERGED


def test_failure_reports_alone_never_evict_a_live_suspect():
    assert isinstance(verdict(rep=report(reporter="c"), heard=[("a", Blame.NONE)]), Probe)


def test_in_a_world_of_two_the_other_member_is_the_majority():
    pair = running(["a", "b"])
    v = verdict(rep=report(blame=Blame.UNUSABLE), state=pair,
                inquiry=replace(fresh(), suspect_seq=None))
    assert isinstance(v, Evict) and "reported by 1 of the 1 other member(s)" in v.reason


def test_an_accusation_left_alone_re_forms_the_world_and_evicts_nobody():
    inquiry = admitted(corroboration_deadline=NOW)
    v = verdict(rep=report(blame=Blame.IMPOSSIBLE_ROW), inquiry=inquiry)
    assert isinstance(v, RingBroken) and v.cause == "uncorroborated_accusation"
    assert v.record_detail == "a alone accused rank 1 (b) (impossible_row), every member alive"


@pytest.mark.parametrize("blame", [Blame.IMPOSSIBLE_ROW, Blame.DIVERGED])
def test_an_accusation_of_what_the_whole_world_saw_left_alone_re_forms_the_world(blame):
    v = verdict(rep=report(blame=blame), inquiry=admitted(corroboration_deadline=NOW))
    assert isinstance(v, RingBroken) and v.cause == "uncorroborated_accusation"


def test_an_unusable_address_left_alone_re_forms_the_world():
    # The other neighbour's report may come only at its form timeout: a later world's majority.
    v = verdict(rep=report(blame=Blame.UNUSABLE), inquiry=admitted(corroboration_deadline=NOW))
    assert isinstance(v, RingBroken) and v.cause == "uncorroborated_accusation"


def test_a_dispute_over_one_link_left_alone_evicts_both_ends_and_counts_against_neither():
    # Bytes only the receiver saw: nobody else can tell which is wrong, and a ring cannot hold both.
    v = verdict(rep=report(blame=Blame.UNRECEIVABLE), inquiry=admitted(corroboration_deadline=NOW))
    assert isinstance(v, Evict) and v.reporter_too and not v.count_failure and v.cause is d.Departure.DISPUTED
    assert "accused (unreceivable) by a alone" in v.reason and "both evicted" in v.reason
    assert v.cause.eviction == "dispute"


def test_an_accuser_gone_by_the_deadline_has_no_dispute_left():
    # One accuser, many accusations at once: the first dispute takes it out; the others are dismissed.
    gone = replace(WORLD, workers={w: rec for w, rec in WORLD.workers.items() if w != "a"})
    v = verdict(rep=report(blame=Blame.UNRECEIVABLE), state=gone, inquiry=admitted(corroboration_deadline=NOW))
    assert isinstance(v, Dismiss) and "the accuser is gone" in v.detail


def test_no_dispute_between_members_without_a_link():
    # In a world of five on five hosts, a rank two places away holds no link with the accuser:
    # the world re-forms and nobody is evicted; its ring neighbour (the ring wraps) does.
    five = running(["a", "b", "c", "d", "e"], max_np=5)
    by_rank = {m.rank: m.worker_id for m in five.world}
    accuser = by_rank[0]

    def dispute(suspect):
        inquiry = replace(fresh(), suspect_seq=five.workers[suspect].join_seq,
                          reporter_seq=five.workers[accuser].join_seq, corroboration_deadline=NOW)
        return verdict(rep=report(reporter=accuser, suspect=suspect, blame=Blame.UNRECEIVABLE), state=five,
                       inquiry=inquiry)

    assert isinstance(dispute(by_rank[2]), RingBroken)
    assert isinstance(dispute(by_rank[3]), RingBroken)
    for neighbour in (by_rank[1], by_rank[4]):
        v = dispute(neighbour)
        assert isinstance(v, Evict) and v.reporter_too


def test_a_dispute_waits_for_the_others_first():
    v = verdict(rep=report(blame=Blame.UNUSABLE), inquiry=admitted(corroboration_deadline=NOW + 1))
    assert isinstance(v, AwaitCorroboration)


@pytest.mark.parametrize("blame", [Blame.FALSE_PENDING, Blame.FALSE_LEAVE])
def test_a_claim_only_the_server_sees_left_alone_is_dismissed_and_breaks_no_ring(blame):
    v = verdict(rep=report(blame=blame), inquiry=admitted(corroboration_deadline=NOW))
    assert isinstance(v, Dismiss) and "by a alone, no majority of world 1: not evicted" in v.detail


@pytest.mark.parametrize("announced", [
    replace(WORLD, pending_version=1), replace(WORLD, aborted_version=1),
], ids=["pending", "aborted"])
def test_a_pending_change_the_server_announced_is_no_false_claim_however_many_say_so(announced):
    v = verdict(rep=report(blame=Blame.FALSE_PENDING), heard=[("c", Blame.FALSE_PENDING)], state=announced)
    assert v == Dismiss("the server did announce a change of world 1: b's claim was true")


def test_a_pending_change_never_announced_is_false_once_the_majority_says_so():
    v = verdict(rep=report(blame=Blame.FALSE_PENDING), heard=[("c", Blame.FALSE_PENDING)])
    assert isinstance(v, Evict) and v.cause is d.Departure.BLAMED


def test_a_worker_does_not_report_itself():
    assert verdict(rep=report(suspect="a", blame=Blame.UNUSABLE)) == Dismiss("a worker does not report itself")


def test_an_accused_suspect_without_a_stream_is_evicted_as_any_reported_one():
    v = verdict(stream=LOST, rep=report(blame=Blame.UNUSABLE))
    assert isinstance(v, Evict) and v.cause is d.Departure.REPORTED


def test_an_accusation_still_waits_for_a_suspect_that_may_reattach():
    v = verdict(stream=AWAITED, rep=report(blame=Blame.UNUSABLE), inquiry=fresh(reattach_until=NOW + 1.0))
    assert v == AwaitReattach(NOW + 1.0)


# The majority rule, as a table: who is evicted for every split of 3, 4 and 5 ranks. The suspect is
# rank 0; `accusers` of the others accuse it; the rest say nothing (an honest majority stays silent
# about an honest member; a hostile minority is all that accuses it).
@pytest.mark.parametrize("size, accusers, evicted", [
    (3, 0, False), (3, 1, False), (3, 2, True),
    (4, 0, False), (4, 1, False), (4, 2, True), (4, 3, True),
    (5, 0, False), (5, 1, False), (5, 2, False), (5, 3, True), (5, 4, True),
    (2, 1, True),   # a world of two: the other member is all there is to ask
])
def test_the_majority_of_the_other_members_decides(size, accusers, evicted):
    names = [f"w{i}" for i in range(size)]
    state = running(names, max_np=size)
    heard = Heard(tuple((w, Blame.DIVERGED) for w in names[1:1 + accusers]))
    assert corroborated(state, "w0", heard) is evicted


# ------------------------------------------------------------------------------- with a stream
def test_a_suspect_with_an_open_stream_is_probed_with_the_heartbeat_timeout_to_answer():
    inquiry, v = judge()
    deadline = NOW + HEARTBEAT_TIMEOUT_S + PROBE_SLACK_S
    assert v == Probe(deadline) and inquiry.probe_deadline == deadline


def test_a_probed_suspect_is_awaited_until_the_deadline():
    assert verdict(inquiry=probed(deadline=NOW + 1.0)) == AwaitProbe(NOW + 1.0)


def test_a_probed_suspect_that_answers_stays_and_the_world_is_formed_again():
    v = verdict(stream=ANSWERED, inquiry=probed())
    assert v == RingBroken("ring of world 1 broken, every member alive (reported by a: connection reset)",
                           "broken_ring_link", "broken ring link waiting on rank 1 (b), every member alive",
                           "b answered a probe; world 1 re-formed")


def test_a_silent_suspect_whose_connection_stays_alive_to_the_deadline_stays_and_the_world_is_formed_again():
    v = verdict(inquiry=probed(deadline=NOW))
    assert isinstance(v, RingBroken) and "stayed alive (keepalive) for 2 s" in v.detail


def test_a_probed_suspect_that_loses_its_stream_is_evicted_and_counted():
    v = verdict(stream=LOST, inquiry=probed())
    assert isinstance(v, Evict) and (v.cause, v.count_failure, v.detail) == (
        d.Departure.REPORTED, True, "suspect lost its stream")


def test_a_probed_suspect_evicted_meanwhile_is_answered_as_evicted():
    gone = replace(WORLD, workers={w: x for w, x in WORLD.workers.items() if w != "b"})
    assert verdict(stream=LOST, inquiry=probed(), state=gone) == Gone("suspect's stream broke")


# ------------------------------------------------------------------------------ what is recorded
def test_a_collective_timeout_is_recorded_as_such():
    v = verdict(stream=ANSWERED, rep=report(timed_out=True), inquiry=probed())
    assert (v.cause, v.record_detail) == ("collective_timeout",
                                          "collective timeout waiting on rank 1 (b), every member alive")


def test_peer_text_is_escaped_before_it_reaches_a_reason():
    v = verdict(stream=LOST, rep=report(reason="evil\x1b[2J\nline"))
    assert "\\x1b[2J\\nline" in v.reason and "\x1b" not in v.reason


def test_a_report_without_a_reason_reads_unreachable():
    assert verdict(stream=LOST, rep=report(reason="")).reason == "no watch stream; reported by a: unreachable"
