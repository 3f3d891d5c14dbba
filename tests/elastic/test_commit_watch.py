"""elastic.runtime.commit_watch: the step a commit holds, and when a job is overdue for one."""
import pytest

from elastic.runtime.commit_watch import CommitWatch, describe_commit, joiner_note_after, overdue, position
from elastic.state.checkpoint import file_name


class S:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


@pytest.mark.parametrize("attrs, want", [
    ({"step": 70}, "step 70"),
    ({"step": 70, "epoch": 3}, "step 70"),               # the step alone says it
    ({"epoch": 3, "batch": 10}, "epoch 3, batch 10"),
    ({"epoch": 3}, "epoch 3"),
    ({}, ""),
    ({"step": 7.5}, ""),                                # not a count
    ({"step": True}, ""),                               # a flag is not a count either
    ({"step": "70"}, ""),
])
def test_position_is_what_the_state_counts(attrs, want):
    assert position(S(**attrs)) == want


@pytest.mark.parametrize("commit, attrs, want", [
    (7, {"step": 70}, "commit 7 (step 70)"),
    (7, {}, "commit 7"),
    (-1, {"step": 0}, "commit -1 (none made yet)"),
])
def test_describe_commit(commit, attrs, want):
    assert describe_commit(commit, S(**attrs)) == want


@pytest.mark.parametrize("commit, where, want", [
    (7, "step 70", "elastic-commit-000000000007-step-70.ckpt"),
    (3, "epoch 3, batch 10", "elastic-commit-000000000003-epoch-3-batch-10.ckpt"),
    (3, "", "elastic-commit-000000000003.ckpt"),
])
def test_durable_file_names_show_the_step(commit, where, want):
    assert file_name(commit, where) == want


@pytest.mark.parametrize("steps, seconds, max_steps, max_seconds, want", [
    (999, 10.0, 1000, 600.0, None),
    (1000, 10.0, 1000, 600.0, "1000 training steps"),
    (5, 600.0, 1000, 600.0, "600 s of training (5 steps)"),
    (0, 601.0, 1000, 600.0, "601 s of training"),
    (10 ** 6, 10 ** 6, 0, 0.0, None),                     # 0: never
    (10 ** 6, 1.0, 0, 600.0, None),
])
def test_overdue(steps, seconds, max_steps, max_seconds, want):
    assert overdue(steps, seconds, max_steps, max_seconds) == want


def test_the_watch_warns_once_and_a_commit_starts_the_count_again():
    now, said = [0.0], []
    watch = CommitWatch(warn=said.append, max_steps=3, max_seconds=100.0, clock=lambda: now[0])
    for _ in range(2):
        watch.stepped(-1)
    assert said == []
    watch.committed()
    for _ in range(2):
        watch.stepped(0)
    assert said == []                                     # the commit started the count again
    watch.stepped(0)
    assert len(said) == 1 and said[0].startswith("3 training steps since the last state.commit() (commit 0)")
    for _ in range(10):
        watch.stepped(0)
    now[0] = 1000.0
    watch.check(0)
    assert len(said) == 1 and watch.trained == 15


def test_time_alone_makes_a_job_overdue():
    now, said = [0.0], []
    watch = CommitWatch(warn=said.append, max_steps=1000, max_seconds=600.0, clock=lambda: now[0])
    now[0] = 599.0
    watch.check(-1)
    assert said == []
    now[0] = 600.0
    watch.check(-1)
    assert len(said) == 1 and "since the run began, without any state.commit()" in said[0]


@pytest.mark.parametrize("form_timeout, want", [(600.0, 30.0), (60.0, 15.0), (4.0, 1.0)])
def test_a_slow_form_is_explained_after_a_quarter_of_its_timeout_at_most_30_s(form_timeout, want):
    assert joiner_note_after(form_timeout) == want
