"""Straggler detection on the worker, as rules (elastic/runtime/straggler_detector.py): the verdict on a commit
window, when a window closes, when a straggler may leave, the settings, and the detector that
carries the verdict out between two membership allreduces (on a ring formed by hand)."""

import functools
import math
import threading
import time

import numpy as np
import pytest

from elastic.ring.ops import Sum
from elastic.ring.wait_clock import WaitClock
from elastic.ring.communicator import _blocking
from elastic.runtime import boundary as membership_check
from elastic.runtime.straggler_detector import (MIN_EXCESS, Detector, StragglerConfig, Window, judge,
                                                may_leave, window_closes)
from tests.native.harness import run_world
from rendezvous.wire.membership import StragglerReport


def run(windows, factor=1.5, k=3):
    """Judges the windows in turn (each a list of compute seconds, wait = 1 - compute); returns the verdicts."""
    streaks, out = (), []
    for compute in windows:
        v = judge(streaks, Window(tuple(compute), tuple(max(0.0, 1.0 - c) for c in compute)), factor, k)
        streaks = v.streaks
        out.append(v)
    return out


NORMAL = [0.4, 0.4, 0.4, 0.4]
SLOW_2 = [0.4, 0.4, 0.8, 0.4]     # rank 2 computes twice the others
SLOW_0 = [0.9, 0.4, 0.4, 0.4]


# ---------------------------------------------------------------------- the verdict
def test_a_rank_slow_for_k_windows_in_a_row_is_named_at_the_kth():
    verdicts = run([SLOW_2, SLOW_2, SLOW_2])
    assert [v.stragglers for v in verdicts] == [(), (), (2,)]
    assert [v.streaks[2] for v in verdicts] == [1, 2, 3]
    assert verdicts[-1].worst == 2 and verdicts[-1].scores[2] == pytest.approx(2.0)


def test_a_rank_slow_once_is_not_named():
    # A garbage collection, an evaluation on rank 0 between commits: one slow window.
    verdicts = run([NORMAL, SLOW_0, NORMAL, NORMAL, NORMAL])
    assert all(v.stragglers == () for v in verdicts)
    assert verdicts[1].slow == (0,) and verdicts[2].streaks[0] == 0


def test_a_normal_window_breaks_the_streak():
    verdicts = run([SLOW_2, SLOW_2, NORMAL, SLOW_2, SLOW_2])
    assert all(v.stragglers == () for v in verdicts)
    assert run([SLOW_2, SLOW_2, NORMAL, SLOW_2, SLOW_2, SLOW_2])[-1].stragglers == (2,)


def test_a_uniformly_slow_world_names_nobody():
    # Everyone twice as slow: the median moves with them.
    verdicts = run([NORMAL, [0.8, 0.8, 0.8, 0.8], [0.8, 0.8, 0.8, 0.8], [0.8, 0.8, 0.8, 0.8]])
    assert all(v.slow == () and v.stragglers == () for v in verdicts)
    assert verdicts[-1].scores == (1.0, 1.0, 1.0, 1.0)


def test_below_the_factor_is_not_slow():
    assert run([[0.4, 0.4, 0.59, 0.4]] * 5)[-1].stragglers == ()
    assert run([[0.4, 0.4, 0.61, 0.4]] * 3)[-1].stragglers == (2,)
    assert run([[0.4, 0.4, 0.61, 0.4]] * 3, factor=2.0)[-1].stragglers == ()


def test_k_sets_how_many_windows_name_a_straggler():
    assert run([SLOW_2], k=1)[-1].stragglers == (2,)
    assert run([SLOW_2] * 4, k=5)[-1].stragglers == ()


def test_in_a_world_of_two_the_slow_rank_is_compared_with_the_other():
    # The lower median: one slow rank cannot drag the median up to its own pace.
    assert run([[0.3, 0.6]] * 3)[-1].stragglers == (1,)


def test_a_world_of_one_names_nobody():
    assert run([[0.9]] * 5)[-1].stragglers == ()


def test_a_world_that_only_communicates_is_not_judged_on_noise():
    # 2 ms of compute against 1 ms in a 1 s window: twice the median, but it slows nobody down.
    verdicts = run([[0.001, 0.001, 0.002, 0.001]] * 5)
    assert all(v.stragglers == () for v in verdicts)
    excess = 0.4 + MIN_EXCESS + 0.01
    assert run([[0.01, 0.01, excess, 0.01]] * 3)[-1].stragglers == (2,)


def test_the_worst_straggler_is_the_one_evicted_and_ties_go_to_the_lower_rank():
    v = run([[0.4, 0.9, 0.4, 1.0, 0.4]] * 3)[-1]
    assert v.stragglers == (1, 3) and v.worst == 3
    v = run([[0.4, 0.9, 0.4, 0.9, 0.4]] * 3)[-1]
    assert v.worst == 1
    assert run([NORMAL])[-1].worst is None


def test_a_new_world_starts_every_streak_again():
    v = run([SLOW_2, SLOW_2])[-1]
    fresh = judge(v.streaks, Window((0.4, 0.8, 0.4), (0.6, 0.2, 0.6)), 1.5, 3)   # 3 ranks now
    assert fresh.streaks == (0, 1, 0)


def test_scores_are_capped_when_the_median_computes_nothing():
    v = judge((), Window((0.0, 0.0, 0.5), (1.0, 1.0, 0.5)), 1.5, 1)
    assert v.scores[:2] == (1.0, 1.0) and v.scores[2] == 1000.0 and v.stragglers == (2,)


# ---------------------------------------------------------------------- windows
@pytest.mark.parametrize("compute, wait, window_s, closes", [
    ([0.5, 0.6], [0.5, 0.4], 1.0, True),
    ([0.5, 0.6], [0.3, 0.3], 1.0, False),           # not long enough yet: the window goes on
    ([0.5, 0.0], [0.5, 0.0], 0.1, False),           # a rank measured nothing (detection off, new ring)
    ([0.5], [0.5], 0.1, False),                      # a world of one
    ([0.5, math.nan], [0.5, 0.5], 0.1, False),      # not a number from a peer
    ([0.5, -1.0], [0.5, 2.0], 0.1, False),          # a negative time from a peer
    ([0.9, 0.1, 0.1], [0.1, 0.8, 0.7], 1.0, False),  # the median wall time decides: 0.9 < 1
])
def test_a_window_closes_when_every_rank_measured_enough(compute, wait, window_s, closes):
    assert window_closes(compute, wait, window_s) is closes


# ---------------------------------------------------------------------- leaving
@pytest.mark.parametrize("size, min_np, spares, allowed", [
    (4, 3, 0, True),
    (4, 4, 0, False),    # never below min-np ...
    (4, 4, 1, True),     # ... unless a spare takes its place
    (1, 1, 0, False),
    (2, 0, 0, True),     # a job's min-np is at least 1
])
def test_a_straggler_leaves_only_if_the_job_keeps_min_np(size, min_np, spares, allowed):
    assert may_leave(size, min_np, spares) is allowed


# ---------------------------------------------------------------------- settings
def test_the_settings_default_to_report_after_three_windows_at_one_and_a_half_times_the_median():
    c = StragglerConfig()
    assert (c.policy, c.factor, c.windows, c.window_s) == ("report", 1.5, 3, 1.0)
    assert StragglerConfig.from_env({}) == c


def test_the_settings_round_trip_through_the_environment():
    c = StragglerConfig(policy="evict", factor=2.25, windows=4, window_s=0.3)
    env = c.to_env()
    assert env == {"ELASTIC_STRAGGLER_POLICY": "evict", "ELASTIC_STRAGGLER_FACTOR": "2.25",
                   "ELASTIC_STRAGGLER_WINDOWS": "4", "ELASTIC_STRAGGLER_WINDOW": "0.3"}
    assert StragglerConfig.from_env(env) == c
    assert StragglerConfig.from_env({"ELASTIC_STRAGGLER_POLICY": " Off "}).policy == "off"


@pytest.mark.parametrize("env, named", [
    ({"ELASTIC_STRAGGLER_POLICY": "kill"}, "ELASTIC_STRAGGLER_POLICY='kill': use one of off, report, evict"),
    ({"ELASTIC_STRAGGLER_FACTOR": "1"}, "ELASTIC_STRAGGLER_FACTOR='1': must be above 1"),
    ({"ELASTIC_STRAGGLER_FACTOR": "nan"}, "ELASTIC_STRAGGLER_FACTOR='nan': not a finite number"),
    ({"ELASTIC_STRAGGLER_FACTOR": "x"}, "ELASTIC_STRAGGLER_FACTOR='x': not a valid float"),
    ({"ELASTIC_STRAGGLER_WINDOWS": "0"}, "ELASTIC_STRAGGLER_WINDOWS='0': must be a whole number"),
    ({"ELASTIC_STRAGGLER_WINDOWS": "2.5"}, "ELASTIC_STRAGGLER_WINDOWS='2.5': not a valid int"),
    ({"ELASTIC_STRAGGLER_WINDOW": "0"}, "ELASTIC_STRAGGLER_WINDOW='0': must be in (0, 3600] seconds"),
])
def test_a_bad_setting_is_refused_naming_the_variable(env, named):
    with pytest.raises(ValueError) as e:
        StragglerConfig.from_env(env)
    assert str(e.value).startswith(named)


def test_a_bad_setting_given_directly_names_the_field():
    with pytest.raises(ValueError, match="factor 0.5: must be above 1"):
        StragglerConfig(factor=0.5)
    assert StragglerConfig.flag("windows") == "--straggler-windows"


# ---------------------------------------------------------------------- the clock
def test_the_clock_counts_time_inside_a_collective_even_when_it_raises():
    class Ring:
        wait_clock = WaitClock()
        arrival = None   # not a ring kept after the run

        @_blocking
        def collective(self, seconds, fail=False):
            threading.Event().wait(seconds)   # a collective blocked on a peer
            if fail:
                raise RuntimeError("peer lost")

    ring = Ring()
    ring.collective(0.05)
    with pytest.raises(RuntimeError):
        ring.collective(0.05, fail=True)
    assert ring.wait_clock.seconds >= 0.1


def test_the_clock_counts_spans_that_overlap_once():
    clock = WaitClock()
    t = time.perf_counter()
    clock.waited(t - 1.0)          # a span of the last second ...
    clock.waited(t - 0.5)          # ... and one inside it, reported after it (another thread)
    assert 1.0 <= clock.seconds < 1.1


def _async_allreduce_behind_a_slow_rank(flush, comm):
    """Rank 1 computes 1 s before it submits; both compute 0.3 s after submitting, then wait."""
    before = comm.wait_clock.seconds
    if comm.rank == 1:
        threading.Event().wait(1.0)
    handle = comm.allreduce_async_(np.ones(1024, dtype=np.float32), Sum)
    if flush:
        comm.flush()
    threading.Event().wait(0.3)
    comm.synchronize(handle)
    return comm.wait_clock.seconds - before


@pytest.mark.slow
def test_an_async_allreduce_flushed_counts_as_waiting_from_its_submission_until_the_slow_rank_came():
    # As DDP's buckets are: the fast rank waits on the slow one from its submission (t=0) until the
    # slow one's part came (t=1; counted from its synchronize it would be 0.7 s); the slow rank
    # found the other waiting, so its allreduce finished while it computed: it waited not at all.
    fast, slow = run_world(2, functools.partial(_async_allreduce_behind_a_slow_rank, True))
    assert 0.9 <= fast < 1.2 and slow < 0.05, (fast, slow)


@pytest.mark.slow
def test_an_async_allreduce_left_in_its_fusion_bucket_counts_from_its_synchronize():
    # Not flushed, it runs only when synchronize sends it: the fast rank waits from then (t=0.3)
    # until the slow rank's synchronize sent its part (t=1.3); from its submission it would be 1.3 s.
    fast, slow = run_world(2, functools.partial(_async_allreduce_behind_a_slow_rank, False))
    assert 0.9 <= fast < 1.2 and slow < 0.05, (fast, slow)


# ---------------------------------------------------------------------- the detector on a ring
class FakeRing:
    """What the detector reads of a Communicator (its identity), for a detector test without sockets."""

    def __init__(self, rank, size, version=1):
        self.rank, self.size, self.world_version = rank, size, version


class Clocks:
    """One rank's wall clock and seconds inside collectives, moved by the test."""

    def __init__(self):
        self.wall = self.waited = 0.0


def boundary(detectors, rings, compute, tell=True):
    """One membership allreduce of `detectors` after a second of training in which rank r spent
    `compute[r]` outside collectives and the rest inside; then each one's verdict reaches the
    rendezvous (its Heartbeat is answered)."""
    rows = []
    for d, ring, c in zip(detectors, rings, compute):
        d.clocks.wall += 1.0
        d.clocks.waited += 1.0 - c
        rows.append(membership_check.row(0, False, *d.timings(ring)))
    rows = np.stack(rows)   # what the allgather gives every rank
    checks = [membership_check.judge(rows, ring.world_version, d.window_wall(ring)) for d, ring in zip(detectors, rings)]
    assert all(not c.blamed for c in checks)
    verdicts = [d.judge(c.compute, c.wait, ring) for d, c, ring in zip(detectors, checks, rings)]
    for d in detectors if tell else ():
        d.told(d.report)
    return verdicts


def detector(r, policy="evict", room=(1, 0), left=None):
    clocks = Clocks()
    d = Detector(StragglerConfig(policy=policy, window_s=0.5), f"w{r}",
                 leave=lambda why: left.setdefault(r, why) if left is not None else None,
                 room=lambda: room, now=lambda: clocks.wall, waited=lambda: clocks.waited)
    d.clocks = clocks
    return d


def detectors(n, policy="evict", room=(1, 0)):
    left = {}
    return [detector(r, policy, room, left) for r in range(n)], left


def test_every_rank_reaches_the_same_verdict_and_only_the_straggler_asks_to_leave_once_it_is_named():
    ds, left = detectors(4)
    rings = [FakeRing(r, 4) for r in range(4)]
    assert boundary(ds, rings, [0.0] * 4) == [None] * 4          # a new ring: the first window opens
    verdicts = [boundary(ds, rings, SLOW_2) for _ in range(2)]
    assert left == {}
    ds[2].told(None)                                              # no answer from the rendezvous yet
    verdicts.append(boundary(ds, rings, SLOW_2))
    assert all(len(set(vs)) == 1 for vs in verdicts)              # the same on every rank
    assert verdicts[-1][0].stragglers == (2,)
    assert list(left) == [2] and "straggler" in left[2]
    assert ds[2].report.named and ds[2].report.slow_windows == 3 and ds[2].report.score == pytest.approx(2.0, 0.05)
    assert not ds[0].report.named and ds[0].report.score == pytest.approx(1.0, 0.05)


def test_report_names_the_straggler_and_asks_nobody_to_leave():
    ds, left = detectors(4, policy="report")
    rings = [FakeRing(r, 4) for r in range(4)]
    for compute in ([0.0] * 4, SLOW_2, SLOW_2, SLOW_2, SLOW_2):
        boundary(ds, rings, compute)
    assert ds[2].report.named and left == {}


def test_a_straggler_asks_to_leave_only_after_the_rendezvous_has_its_name():
    ds, left = detectors(4)
    rings = [FakeRing(r, 4) for r in range(4)]
    for compute in ([0.0] * 4, SLOW_2, SLOW_2):
        boundary(ds, rings, compute)
    boundary(ds, rings, SLOW_2, tell=False)                       # the third: no Heartbeat carried it yet
    assert ds[2].report.named and left == {}
    ds[2].told(StragglerReport(1, 2.0, 2, False))                  # an older verdict answered: still not
    assert left == {}
    ds[2].told(ds[2].report)
    assert list(left) == [2]


def test_a_straggler_that_is_no_longer_the_worst_stays():
    ds, left = detectors(4)
    rings = [FakeRing(r, 4) for r in range(4)]
    for compute in ([0.0] * 4, [0.4, 0.4, 0.8, 0.4], [0.4, 0.4, 0.8, 0.4]):
        boundary(ds, rings, compute, tell=False)
    boundary(ds, rings, [0.4, 0.9, 0.8, 0.4], tell=False)          # rank 2 named, rank 1 the worst now
    boundary(ds, rings, [0.4, 0.9, 0.8, 0.4], tell=False)
    boundary(ds, rings, [0.4, 0.9, 0.8, 0.4], tell=False)
    assert ds[2].report.named and ds[1].report.named
    for d in ds:
        d.told(d.report)
    assert list(left) == [1]


def test_a_straggler_stays_when_the_job_would_drop_below_min_np():
    ds, left = detectors(4, room=(4, 0))
    rings = [FakeRing(r, 4) for r in range(4)]
    for compute in ([0.0] * 4, SLOW_2, SLOW_2, SLOW_2):
        boundary(ds, rings, compute)
    assert ds[2].report.named and left == {}


def test_one_rank_with_detection_off_turns_it_off_for_the_world():
    ds, left = detectors(3)
    ds[1] = detector(1, policy="off")
    rings = [FakeRing(r, 3) for r in range(3)]
    for compute in ([0.0] * 3, [0.4, 0.4, 0.9], [0.4, 0.4, 0.9], [0.4, 0.4, 0.9]):
        assert boundary(ds, rings, compute) == [None] * 3
    # ... and it sends zeros, in the row every rank sends.
    assert ds[1].timings(rings[1]) == (0.0, 0.0) and ds[1].window_wall(rings[1]) > 0


def test_a_new_world_opens_a_new_window():
    ds, left = detectors(4)
    rings = [FakeRing(r, 4) for r in range(4)]
    for compute in ([0.0] * 4, SLOW_2, SLOW_2):
        boundary(ds, rings, compute)
    rings = [FakeRing(r, 4, version=2) for r in range(4)]   # re-formed after two slow windows
    for compute in ([0.0] * 4, SLOW_2, SLOW_2):
        boundary(ds, rings, compute)
    assert left == {} and ds[2].report.slow_windows == 2 and ds[2].report.world_version == 2
