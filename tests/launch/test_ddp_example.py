"""examples/train_ddp.py, the plain DDP script, under a real elastic-run: it learns, and a
worker SIGKILLed mid-epoch costs the others a restore, not a restart."""

from __future__ import annotations

import os
import re
import signal
import sys

from tests.waiting import wait_until

from .launch_helpers import REPO, processes_with
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

DDP_EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")


def _losses(text: str) -> list:
    return [float(x) for x in re.findall(r"\] epoch \d+: loss ([0-9.]+) over", text)]


def _worker_pid(p, worker_id: str) -> int:
    """The pid of the launcher's worker ``worker_id`` (the example writes no pid file)."""
    needle = f"ELASTIC_WORKER_ID={worker_id}".encode()

    def find():
        for pid in processes_with(p.marker):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        return pid
            except OSError:
                pass
        return None
    return wait_until(find, 30, f"worker {worker_id}'s process")


def test_the_ddp_example_learns(launch):
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, DDP_EXAMPLE, "--epochs", "3"])
    assert p.wait(120) == 0, p.text()
    losses = _losses(p.text())
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, p.text()
    p.wait_for(r"^\[hA-\d\] done in world version 1$", 1)   # rank 0 prints it
    p.wait_no_leftovers()


def test_the_ddp_example_survives_a_sigkill_and_the_respawn_rejoins(launch):
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", "--max-restarts", "1",
               command=[sys.executable, DDP_EXAMPLE, "--epochs", "6", "--step-sleep", "0.05"])
    p.wait_for(r"^\[hA-\d\] epoch 0: loss", 90)
    os.kill(_worker_pid(p, "hA-2"), signal.SIGKILL)
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2; recovered [0-9.]+ s after hA-2 killed", 30)
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hA-2-r1", 60)
    assert p.wait(180) == 0, p.text()
    assert "Segmentation" not in p.text()
    losses = _losses(p.text())
    assert len(losses) == 6 and losses[-1] < losses[0], p.text()
    p.wait_no_leftovers()
