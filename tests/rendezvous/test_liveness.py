"""The liveness clocks of a job, as rules (rendezvous/server/liveness.py): pure, each instant passed in."""
from __future__ import annotations

import pytest

from rendezvous.server.liveness import Idle, Liveness

from .fakes import running

T = 2.0   # the heartbeat timeout


def test_a_new_job_is_dropped_a_heartbeat_timeout_after_creation_if_nobody_watches():
    live = Liveness.of_new_job(T, now=100.0)
    assert live.next_deadline() == 102.0
    assert live.idle(101.9, watched=False, forming=True) is Idle.NOT_DUE
    assert live.idle(102.0, watched=False, forming=True) is Idle.DROP


@pytest.mark.parametrize("watched, forming, verdict", [
    (False, True, Idle.DROP),     # no world, nobody watching: it holds a place for nothing
    (True, True, Idle.KEPT),      # a worker watches it: it is forming
    (False, False, Idle.KEPT),    # it has a world: its members' liveness is what counts
    (True, False, Idle.KEPT),
])
def test_at_its_idle_deadline_only_an_unwatched_job_without_a_world_is_dropped(watched, forming,
                                                                                 verdict):
    live = Liveness.of_new_job(T, now=0.0)
    assert live.idle(5.0, watched=watched, forming=forming) is verdict


def test_a_kept_job_stops_its_idle_clock_until_its_streams_are_gone_again():
    live = Liveness.of_new_job(T, now=0.0)
    assert live.idle(5.0, watched=True, forming=True) is Idle.KEPT
    assert live.next_deadline() is None
    assert live.idle(50.0, watched=False, forming=True) is Idle.NOT_DUE
    assert live.streams_gone(now=60.0) is True         # the last stream closed: the clock starts
    assert live.streams_gone(now=61.0) is False        # already running: not restarted
    assert live.next_deadline() == 62.0


def test_opening_a_watch_stops_the_idle_clock_and_meets_the_deadline():
    live = Liveness.of_new_job(T, now=0.0)
    live.joined("a", now=0.5)
    assert live.awaits_watch("a")
    live.watch_opened("a")
    assert not live.awaits_watch("a") and live.next_deadline() is None
    assert live.missed_watches(now=100.0) == []


def test_a_failed_drop_is_tried_again_a_heartbeat_timeout_later():
    live = Liveness.of_new_job(T, now=0.0)
    assert live.idle(3.0, watched=False, forming=True) is Idle.DROP
    live.retry_drop(now=3.5)
    assert live.idle(5.0, watched=False, forming=True) is Idle.NOT_DUE
    assert live.next_deadline() == 5.5


def test_a_joined_worker_must_open_its_watch_within_the_heartbeat_timeout():
    live = Liveness(T)
    live.joined("a", now=10.0)
    live.joined("b", now=11.0)
    assert live.next_deadline() == 12.0
    assert live.missed_watches(now=11.9) == []
    assert live.missed_watches(now=12.0) == [("a", "did not open its watch stream within 2 s of "
                                                    "joining")]
    assert live.missed_watches(now=12.5) == []          # each missed deadline is told once
    assert [w for w, _ in live.missed_watches(now=13.0)] == ["b"]
    assert live.next_deadline() is None


def test_joining_again_replaces_the_earlier_deadline():
    live = Liveness(T)
    live.joined("a", now=0.0)
    live.joined("a", now=5.0)
    assert live.missed_watches(now=3.0) == [] and live.next_deadline() == 7.0


def test_after_a_leader_change_every_registered_worker_has_the_reattach_window():
    live = Liveness.after_leader_change(T, ["a", "b"], now=100.0, window_s=7.0)
    assert live.awaits_watch("a") and live.awaits_watch("b") and not live.awaits_watch("c")
    assert live.next_deadline() == 107.0
    live.watch_opened("a")
    assert live.missed_watches(now=107.0) == [("b", "did not reattach within 7 s of a leader "
                                                    "change")]


@pytest.mark.parametrize("worker, starts", [
    (None, True),     # the world's ring broke: no one is named
    ("a", True),      # a member
    ("spare", False),  # outside the world: no world waits on it
])
def test_the_recovery_clock_starts_at_a_failure_in_the_world(worker, starts):
    live = Liveness(T)
    live.failure_signal(50.0, running(), worker)
    assert (live.failure_at == 50.0) is starts


def test_the_recovery_clock_keeps_its_first_failure_and_stops_at_the_next_world():
    live = Liveness(T)
    state = running()
    live.failure_signal(50.0, state, "a")
    live.failure_signal(50.3, state, "b")
    assert live.world_announced(51.25) == pytest.approx(1.25)
    assert live.failure_at is None
    assert live.world_announced(60.0) is None           # a world after no failure measures nothing


def test_watch_deadlines_are_told_in_the_order_they_fall_due_whatever_the_order_set():
    live = Liveness(T)
    live.joined("late", now=10.0)
    live.joined("early", now=5.0)        # the wall clock stepped back
    live.joined("rejoined", now=1.0)
    live.joined("rejoined", now=20.0)    # its first deadline (3.0) is no longer its own
    live.joined("opened", now=2.0)
    live.watch_opened("opened")
    assert live.next_deadline() == 7.0
    assert [w for w, _ in live.missed_watches(now=12.0)] == ["early", "late"]
    assert live.next_deadline() == 22.0
    assert [w for w, _ in live.missed_watches(now=22.0)] == ["rejoined"]
    assert live.next_deadline() is None


def test_many_joins_and_opened_watches_leave_only_the_deadlines_still_set():
    live = Liveness(T)
    for i in range(1000):
        live.joined(f"w{i}", now=float(i))
        if i % 10:
            live.watch_opened(f"w{i}")
    assert len(live._due) <= 2 * len(live.watch_by) + 64 + 1   # stale entries are dropped
    assert [w for w, _ in live.missed_watches(now=2000.0)] == [f"w{i}" for i in range(0, 1000, 10)]
