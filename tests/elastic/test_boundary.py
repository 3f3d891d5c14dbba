"""The membership check's rows and the verdict on them (elastic/runtime/boundary.py), as a table:
pure, no ring. Each rank writes only its own row; every rank judges the same rows alike."""

import math

import numpy as np
import pytest

from elastic.runtime.boundary import WALL_SLACK_S, Check, judge, row

V = 7          # the world version of the ring
WALL = 2.0     # the open window has lasted this long on the judging rank


def rows(*rs):
    return np.stack([row(*r) for r in rs])


QUIET = (0, False, 1.0, 1.0)
PENDING = (V, False, 1.0, 1.0)


def test_quiet_rows_change_nothing_and_hand_every_rank_its_timings():
    check = judge(rows(QUIET, (0, False, 1.5, 0.5), QUIET), V, WALL)
    assert check == Check(compute=(1.0, 1.5, 1.0), wait=(1.0, 0.5, 1.0))


@pytest.mark.parametrize("claims, size, switch", [
    (1, 1, True), (1, 2, False), (2, 2, True),
    (1, 3, False), (2, 3, True), (3, 3, True),
    (1, 4, False), (2, 4, False), (3, 4, True),
    (2, 5, False), (3, 5, True),
])
def test_a_pending_change_takes_effect_when_a_majority_saw_it_announced(claims, size, switch):
    check = judge(rows(*[PENDING] * claims, *[QUIET] * (size - claims)), V, WALL)
    assert check.switch is switch and check.claimers == tuple(range(claims)) and not check.blamed


def test_a_rank_that_leaves_switches_every_rank_on_its_own_word():
    check = judge(rows(QUIET, (0, True, 1.0, 1.0), QUIET), V, WALL)
    assert check.switch and check.leavers == (1,) and not check.blamed


@pytest.mark.parametrize("bad, why", [
    ((V + 1, False, 1.0, 1.0), "pending for world version 8, not for its own 7"),
    ((V - 1, False, 1.0, 1.0), "pending for world version 6"),
    ((0, 2.0, 1.0, 1.0), "a leave flag of 2"),
    ((0, False, -1.0, 1.0), "negative timings"),
    ((0, False, 1.0, -0.1), "negative timings"),
    ((0, False, math.nan, 1.0), "not a finite number"),
    ((0, False, math.inf, 0.0), "not a finite number"),
    ((math.nan, False, 1.0, 1.0), "not a finite number"),
    ((0, False, 1000.0, 0.0), "1e+03 s of computing and waiting in a commit window that lasted 2 s"),
    ((0, False, 2 * WALL, WALL_SLACK_S + 0.01), "in a commit window"),
], ids=["newer-world", "older-world", "leave-flag", "negative-compute", "negative-wait", "nan", "inf",
        "nan-pending", "1000s", "just-over"])
def test_a_row_no_honest_worker_writes_blames_its_rank_on_every_rank(bad, why):
    check = judge(rows(QUIET, bad, QUIET), V, WALL)
    assert [r for r, _ in check.blamed] == [1] and why in check.blamed[0][1]
    assert not check.switch and not check.leavers   # a blamed row decides nothing


def test_timings_up_to_twice_the_window_and_a_second_are_believed():
    # Windows open at the same collective on every rank, and each measured before the allgather
    # ended on the judging rank: a rank that arrived late to the boundary measured a little more.
    assert not judge(rows(QUIET, (0, False, 2 * WALL, WALL_SLACK_S)), V, WALL).blamed


def test_on_a_new_ring_every_honest_row_is_zeros_so_any_time_beyond_a_second_is_impossible():
    assert not judge(rows(row_zero := (0, False, 0.0, 0.0), row_zero), V, 0.0).blamed
    assert judge(rows((0, False, 0.0, 0.0), (0, False, 5.0, 0.0)), V, 0.0).blamed[0][0] == 1


def test_without_a_window_to_compare_with_only_the_values_themselves_are_judged():
    assert not judge(rows(QUIET, (0, False, 1000.0, 0.0)), V, None).blamed
    assert judge(rows(QUIET, (0, False, -1.0, 0.0)), V, None).blamed


def test_every_blamed_rank_is_named_in_rank_order():
    check = judge(rows((0, False, -1.0, 0.0), QUIET, (V + 3, False, 0.0, 0.0)), V, WALL)
    assert [r for r, _ in check.blamed] == [0, 2]


def test_a_ring_without_a_world_version_never_switches_on_zeros():
    assert judge(rows((0, False, 0.0, 0.0), (0, False, 0.0, 0.0)), 0, None) == Check(compute=(0.0, 0.0),
                                                                                       wait=(0.0, 0.0))


def test_every_rank_returned_is_the_worlds_success():
    check = judge(rows((0, False, 0.0, 0.0, True), (0, False, 0.0, 0.0, True), (0, False, 0.0, 0.0, True)), V, WALL)
    assert check.done and not check.switch and not check.leavers and not check.blamed


@pytest.mark.parametrize("returned", [(0,), (1,), (0, 2)])
def test_ranks_that_returned_while_others_train_on_leave_and_the_others_switch(returned):
    check = judge(rows(*[(0, False, 1.0, 1.0, r in returned) for r in range(3)]), V, WALL)
    assert not check.done and check.switch and check.leavers == returned


@pytest.mark.parametrize("flag", [2.0, -1.0, 0.5, math.nan])
def test_a_returned_flag_other_than_0_or_1_blames_its_rank(flag):
    table = rows(QUIET, QUIET)
    table[1, 4] = flag
    check = judge(table, V, WALL)
    assert [r for r, _ in check.blamed] == [1] and not check.done


def test_the_same_rows_give_the_same_verdict_whoever_judges_them():
    table = rows(PENDING, QUIET, (0, False, -2.0, 0.0), PENDING)
    assert len({judge(table.copy(), V, WALL) for _ in range(4)}) == 1
