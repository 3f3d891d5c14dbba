"""What each decided action is, said once (rendezvous/server/description.py): the log line, who hears of
it, what is counted. The event-log and Status side of the same descriptions is in
test_server_events.py."""
from __future__ import annotations

import typing

import pytest

from rendezvous.server import decision as d
from rendezvous.server.description import Audience, describe

M = (d.Member("a", "h1", "h1:1", 0, 0, 1, 0, 2, 5), d.Member("b", "h2", "h2:1", 1, 0, 1, 1, 2, 5))


CASES = [
    (d.AnnounceWorld(4, M, ("c",)), "world 4 announced: 2 member(s), 1 standby", Audience.NEW_WORLD),
    (d.AnnouncePending(3, "worker c on h3 joined"), "change pending for world 3: worker c on h3 "
                                                    "joined", Audience.WORLD_BEFORE),
    (d.AnnounceAbort(3, "worker b evicted"), "abort world 3: worker b evicted",
     Audience.WORLD_BEFORE),
    (d.Dropped("b", "worker b left"), "worker b dropped: worker b left", Audience.DROPPED),
    (d.Dropped("b", "stream broken", d.Departure.STREAM_BROKEN), "worker b dropped: stream broken",
     Audience.DROPPED),
    (d.AnnounceFinished(False, "below min_np"), "finished (failed): below min_np",
     Audience.EVERYONE),
    (d.Rejected("b", "host h2 is blacklisted", d.Refusal.BLACKLISTED),
     "worker b refused: host h2 is blacklisted", Audience.CALLER),
]


@pytest.mark.parametrize("action, summary, audience", CASES)
def test_each_action_has_one_log_line_and_one_audience(action, summary, audience):
    what = describe(action, 3)
    assert (what.summary, what.audience) == (summary, audience)


def test_every_kind_of_action_the_decision_returns_is_described():
    assert {type(action) for action, _, _ in CASES} == set(typing.get_args(d.Action))


def test_a_new_world_carries_its_own_version_and_other_actions_the_version_they_were_decided_in():
    assert describe(d.AnnounceWorld(4, M, ()), 3).world_version == 4
    assert describe(d.Dropped("b", "left"), 3).world_version == 3
    assert describe(d.AnnounceFinished(True, "done"), 3).world_version == 3


@pytest.mark.parametrize("cause", list(d.Departure))
def test_only_a_session_that_ended_by_failure_counts_as_an_eviction_with_its_cause(cause):
    what = describe(d.Dropped("b", "why", cause), 3)
    assert what.eviction == cause.eviction
    assert (what.event == "worker_left") is (cause is d.Departure.LEFT)
    assert (what.event == "straggler_left") is (cause is d.Departure.STRAGGLER)


@pytest.mark.parametrize("action", [d.AnnouncePending(3, "x"), d.AnnounceAbort(3, "x"),
                                    d.Dropped("b", "x", d.Departure.FAILED),
                                    d.AnnounceFinished(True, "x")])
def test_only_an_announced_world_counts_as_one_and_stops_the_recovery_clock(action):
    assert describe(d.AnnounceWorld(4, M, ()), 3).world_announced
    what = describe(action, 3)
    assert not what.world_announced and what.eviction in (None, "other")
