"""Commits a user can read and cannot forget, in real jobs under elastic-run: a job that trains
long without a commit is warned once; a failure that goes back to "commit -1" says that training
restarts from the beginning; the run's last commit is durable whatever checkpoint_every; durable
files and log lines show the training step each commit holds."""
from __future__ import annotations

import os
import re
import sys

import pytest

from .launch_helpers import wait_until

JOB = os.path.join(os.path.dirname(__file__), "commit_job.py")

pytestmark = pytest.mark.slow


def test_a_job_that_never_commits_is_warned_once_by_rank_0_naming_state_commit(launch):
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, JOB, "no-commit"], LW_STEPS="60",
               ELASTIC_COMMIT_WARN_STEPS="25")
    assert p.wait(120) == 0, p.text()
    warnings = [line for line in p.stderr if "training steps since the run began" in line]
    assert len(warnings) == 1, p.text()
    assert "25 training steps since the run began, without any state.commit()" in warnings[0]
    assert "a failure now sends every worker back to the beginning" in warnings[0]
    assert "ELASTIC_COMMIT_WARN_STEPS" in warnings[0]


def test_a_job_that_commits_is_not_warned(launch, tmp_path):
    p = launch("--np", "1", "--host", "hA", command=[sys.executable, JOB, "durable-last"], LW_STEPS="30",
               LW_CKPT=str(tmp_path / "ck"), ELASTIC_COMMIT_WARN_STEPS="25")
    assert p.wait(120) == 0, p.text()
    assert "state.commit()" not in p.text()


def test_the_last_commit_of_a_run_is_durable_and_every_file_shows_its_step(launch, tmp_path):
    ck = tmp_path / "ck"
    # Commits 0..6 hold steps 1..7; checkpoint_every=4 writes commits 0 and 4, the end commit 6.
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, JOB, "durable-last"], LW_STEPS="7",
               LW_CKPT=str(ck))
    assert p.wait(120) == 0, p.text()
    assert sorted(os.listdir(ck)) == ["elastic-commit-000000000004-step-5.ckpt",
                                      "elastic-commit-000000000006-step-7.ckpt"], p.text()


def test_a_failure_with_no_commit_says_training_restarts_from_the_beginning(launch):
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, JOB, "never-commits"], LW_STEPS="100000",
               ELASTIC_COMMIT_WARN_STEPS="0", ELASTIC_COMMIT_WARN_SECONDS="0")
    p.wait_for(r"^\[hA-\d\] step 5 size 2$", 90)
    p.kill_worker("hA-1")
    m = p.wait_for(r"restoring commit -1: no state.commit\(\) was made in this run, so training RESTARTS FROM THE "
                   r"BEGINNING", 60)
    assert m.string.startswith("[hA-0]") and "Call state.commit() every few steps" in m.string
    assert "state.commit()" not in "\n".join(line for line in p.stderr if "training steps since" in line)
    p.proc.terminate()
    p.wait(60)


def test_a_joiner_waiting_on_a_commit_that_never_comes_says_why_and_the_job_still_completes(launch):
    first = launch("--np", "1", "--host", "hA", command=[sys.executable, JOB, "never-commits"], LW_STEPS="700",
                   ELASTIC_COMMIT_WARN_STEPS="0", ELASTIC_COMMIT_WARN_SECONDS="0")
    port = first.wait_for(r"rendezvous server for job default on 127\.0\.0\.1:(\d+)", 60).group(1)
    token = first.wait_for(r"its token is in (\S+) ", 60).group(1)
    first.wait_for(r"^\[hA-0\] step 5 size 1$", 90)
    # Another host joins the running job, which never commits.
    second = launch("--np", "1", "--host", "hB", "--rendezvous", f"127.0.0.1:{port}", "--job-id", "default",
                    "--token-file", token, command=[sys.executable, JOB, "never-commits"], LW_STEPS="700")
    m = second.wait_for(r"^\[hB-0\] .*worker hB-0 has waited \d+ s for the ring of world 2 to form: members "
                        r"still in the running world switch at their next state.commit\(\)", 90)
    assert "the form gives up after ELASTIC_FORM_TIMEOUT (60 s)" in m.string
    assert first.wait(120) == 0, first.text()
    assert second.wait(60) == 0, second.text()
