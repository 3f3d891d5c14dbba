"""elastic-run's GPU placement: which GPUs it sees, one per slot for the slot's whole life, and
clear errors where the flags cannot be met (pure functions, and the flags as parse() reads them)."""

from __future__ import annotations

import sys

import pytest

from elastic.launch.environment import spawn_env
from elastic.launch.flags import UsageError, parse
from elastic.launch.gpus import gpu_env, placement, visible_gpus
from elastic.launch.procs import describe_exit, respawnable
from elastic.runtime.worker_config import DEVICE_ABORT_STUCK_EXIT

PY = sys.executable


def test_the_launchers_cuda_visible_devices_comes_first_and_ends_at_an_invalid_entry(tmp_path):
    (tmp_path / "0000:01:00.0").mkdir()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,GPU-ab12, 5"}, str(tmp_path)) == ("3", "GPU-ab12", "5")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,4"}, str(tmp_path)) == ("2",)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)) == ()


def test_without_cuda_visible_devices_the_drivers_gpu_list_counts(tmp_path):
    for bus in ("0000:01:00.0", "0000:41:00.0", "0000:81:00.0"):
        (tmp_path / bus).mkdir()
    assert visible_gpus({}, str(tmp_path)) == ("0", "1", "2")
    assert visible_gpus({}, str(tmp_path / "absent")) == ()


def test_each_slot_gets_its_own_gpu_and_local_rank_zero():
    gpus = placement(None, ("3", "5", "7"), np=2, discovery=False)
    assert gpus == ("3", "5", "7")
    assert gpu_env(gpus, 0) == {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "0"}
    assert gpu_env(gpus, 2) == {"CUDA_VISIBLE_DEVICES": "7", "LOCAL_RANK": "0"}
    assert placement(2, ("3", "5", "7"), np=2, discovery=False) == ("3", "5")
    assert gpu_env((), 4) == {}


@pytest.mark.parametrize("gpus_per_host, visible, np, message", [
    (None, ("0", "1"), 3, r"--np 3 workers, but 2 GPU\(s\)"),
    (4, ("0", "1"), 2, r"--gpus-per-host 4, but this host shows 2 GPU\(s\)"),
    (-1, ("0",), 1, "must not be negative"),
])
def test_what_cannot_be_met_is_an_error_naming_the_flags(gpus_per_host, visible, np, message):
    with pytest.raises(ValueError, match=message):
        placement(gpus_per_host, visible, np=np, discovery=False)


def test_no_gpus_or_zero_means_no_placement():
    assert placement(None, (), np=8, discovery=False) == ()
    assert placement(0, ("0", "1"), np=8, discovery=False) == ()


def test_the_flag_reaches_every_workers_environment_and_a_respawn_keeps_its_gpu(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "4,6", "PATH": "/usr/bin:/bin"}
    cfg = parse(["--np", "2", "--", PY, "train.py"], env=env)
    assert cfg.gpus == ("4", "6")
    token = tmp_path / "token"
    token.write_text("x")
    common = dict(addresses=("127.0.0.1:2379",), local_slots=2, token_file=str(token), metrics_env={})
    first = spawn_env(env, cfg, slot=1, incarnation=0, worker_id="h-1", **common)
    again = spawn_env(env, cfg, slot=1, incarnation=1, worker_id="h-1-r1", **common)
    for e in (first, again):
        assert (e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"], e["ELASTIC_LOCAL_SLOT"]) == ("6", "0", "1")
    off = parse(["--np", "3", "--gpus-per-host", "0", "--", PY, "train.py"], env=env)
    assert off.gpus == ()
    e = spawn_env(env, off, slot=2, incarnation=0, worker_id="h-2", **common)
    assert e["CUDA_VISIBLE_DEVICES"] == "4,6" and e["LOCAL_RANK"] == "2"   # inherited; torchrun's slot


def test_more_workers_than_gpus_is_a_usage_error():
    with pytest.raises(UsageError, match=r"--np 3 workers, but 2 GPU\(s\).*--gpus-per-host 0"):
        parse(["--np", "3", "--", PY, "train.py"], env={"CUDA_VISIBLE_DEVICES": "0,1"})


def test_a_worker_wedged_in_its_device_abort_is_respawned_like_a_killed_one():
    assert respawnable(DEVICE_ABORT_STUCK_EXIT) and respawnable(-9) and respawnable(128 + 9)
    assert not respawnable(1) and not respawnable(0)
    assert "abort of its device communicator did not return" in describe_exit(DEVICE_ABORT_STUCK_EXIT)
