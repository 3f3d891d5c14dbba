"""`elastic-rendezvous status` with no flags finds the job an elastic-run of this user serves here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .launch_helpers import REPO, wait_until

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane


def status(runtime_dir: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime_dir, PYTHONPATH=REPO)
    env.pop("ELASTIC_TOKEN_FILE", None)
    return subprocess.run([sys.executable, "-m", "rendezvous", "status", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_status_without_flags_finds_the_running_job_and_nothing_once_it_ended(launch, tmp_path):
    runtime = str(tmp_path / "run")
    os.mkdir(runtime, 0o700)
    p = launch("--np", "2", "--host", "hA", "--job-id", "found-me", LW_STEPS="100000", XDG_RUNTIME_DIR=runtime)
    p.wait_training(2)
    out = status(runtime)
    assert out.returncode == 0, out.stderr
    assert "job found-me  phase RUNNING" in out.stdout and out.stdout.count(" hA ") == 2, out.stdout
    p.finish()
    assert p.wait(60) == 0, p.text()
    gone = status(runtime)
    assert gone.returncode != 0
    assert "no elastic-run job of this user found on this machine" in gone.stderr
    assert "--server HOST:PORT" in gone.stderr, gone.stderr


def test_two_jobs_of_the_user_are_listed_and_one_is_chosen_by_its_id(launch, tmp_path):
    runtime = str(tmp_path / "run")
    os.mkdir(runtime, 0o700)
    first = launch("--np", "1", "--host", "hA", "--job-id", "one", LW_STEPS="100000", XDG_RUNTIME_DIR=runtime)
    second = launch("--np", "1", "--host", "hB", "--job-id", "two", LW_STEPS="100000", XDG_RUNTIME_DIR=runtime)
    first.wait_training(1)
    second.wait_training(1)
    both = status(runtime)
    assert both.returncode != 0 and "2 elastic-run jobs of this user" in both.stderr, both.stderr
    assert "choose one with --job ID" in both.stderr
    chosen = status(runtime, "--job", "two")
    assert chosen.returncode == 0 and "job two  phase RUNNING" in chosen.stdout, chosen.stderr
    for p in (first, second):
        p.finish()
        assert p.wait(60) == 0, p.text()
    wait_until(lambda: not os.listdir(os.path.join(runtime, "elastic-ring", "jobs")), 10, "the job files gone")
