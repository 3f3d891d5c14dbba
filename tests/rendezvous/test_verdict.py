"""Table tests of the failure-report judgement: pure function, no sockets, futures, clocks or waits."""
from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous.server import decision as d
from rendezvous.server.verdict import (PROBE_SLACK_S, AwaitProbe, AwaitReattach, Dismiss, Evict, Gone, Inquiry, Probe,
                                       Refuse, Report, RingBroken, SuspectStream, judge_report)

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
    return replace(fresh(), suspect_seq=state.workers["b"].join_seq, **kw)


def probed(deadline: float = NOW + 1.0, state=WORLD) -> Inquiry:
    return admitted(state, probe_deadline=deadline)


def judge(stream=OPEN, rep=None, inquiry=None, state=WORLD, now=NOW):
    return judge_report(state, stream, rep or report(), inquiry or fresh(), now)


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


# --------------------------------------------------------------------------- unusable address
def test_an_unusable_ring_address_evicts_the_suspect_even_while_its_stream_is_open():
    v = verdict(rep=report(unusable_address=True))
    assert v == Evict("unusable ring address; reported by a: connection reset",
                      d.Departure.UNUSABLE_ADDRESS, True, "suspect's ring address is unusable")


def test_an_unusable_ring_address_still_waits_for_a_suspect_that_may_reattach():
    v = verdict(stream=AWAITED, rep=report(unusable_address=True), inquiry=fresh(reattach_until=NOW + 1.0))
    assert v == AwaitReattach(NOW + 1.0)


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
