"""elastic-run under srun, without Slurm: what it reads from Slurm's environment (pure functions,
table tests), the flags it derives, and the announcement through which the nodes find the server.
The same launcher on a real Slurm cluster: tests/slurm/."""

from __future__ import annotations

import os
import re
import stat
import sys

import pytest

from elastic.launch.flags import UsageError, parse
from elastic.launch.slurm import (Announcement, SlurmEnvError, SlurmStep, announcement_dir, check_base_dir,
                                  expand_counts, expand_hostlist, from_slurm_env, read_announcement, serve_host,
                                  wait_for_announcement)

# What srun gives the task on node2 of a 3-node job (seen on Slurm 22.05, `srun --ntasks-per-node=1`).
STEP = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "node2", "SLURM_JOB_NODELIST": "node[1-3]",
    "SLURM_JOB_NUM_NODES": "3", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "1",
}


def step(**changes):
    env = dict(STEP)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


@pytest.mark.parametrize("text, names", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("n[01-03,7],gpu5", ["n01", "n02", "n03", "n7", "gpu5"]),     # each range keeps its own width
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[3]", ["x3"]),
])
def test_a_compressed_host_list_expands_in_order(text, names):
    # As `scontrol show hostnames` expands them (checked on Slurm 22.05).
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text, message", [
    ("n[1-3", "unbalanced brackets"),
    ("n1-3]", "unbalanced brackets"),
    ("n[[1]]", "nested brackets"),
    ("n[a-b]", "'a-b' is not a number or a range"),
    ("n[3-1]", "runs backwards"),
    ("n[1-99999999]", "more than 65536 nodes"),
    ("n1,,n2", "an empty node name"),
])
def test_a_bad_host_list_is_refused_naming_the_variable(text, message):
    with pytest.raises(SlurmEnvError, match=re.escape(message)) as e:
        expand_hostlist(text)
    assert str(e.value).startswith(f"SLURM_JOB_NODELIST={text!r}")


@pytest.mark.parametrize("text, counts", [("1", [1]), ("1(x3)", [1, 1, 1]), ("2(x2),1", [2, 2, 1]), ("4,4", [4, 4])])
def test_per_node_counts_expand(text, counts):
    assert expand_counts(text, "V") == counts


@pytest.mark.parametrize("text", ["", "x", "2(3)", "1(x)"])
def test_bad_per_node_counts_are_refused(text):
    with pytest.raises(SlurmEnvError, match=r"^V="):
        expand_counts(text, "V")


def test_outside_an_srun_step_there_is_no_slurm_job():
    assert from_slurm_env({}) is None
    # The batch script itself has a job id but no step id: the single-machine default applies there.
    assert from_slurm_env(step(SLURM_STEP_ID=None)) is None


def test_a_step_reads_the_job_the_node_and_the_batch_host():
    s = from_slurm_env(STEP)
    assert s == SlurmStep(job_id="4242", node="node2", job_nodes=("node1", "node2", "node3"), step_nodes=3,
                          restart_count=0, workers_per_node=1, np_source="SLURM_NTASKS_PER_NODE")
    assert s.head == "node1" and not s.is_head and s.spans_nodes
    assert from_slurm_env(step(SLURMD_NODENAME="node1")).is_head
    assert from_slurm_env(step(SLURM_RESTART_COUNT="2")).restart_count == 2
    # Older variable names still count: SLURM_NODELIST.
    assert from_slurm_env(step(SLURM_JOB_NODELIST=None, SLURM_NODELIST="a,b")).job_nodes == ("a", "b")


@pytest.mark.parametrize("changes, workers, source", [
    ({}, 1, "SLURM_NTASKS_PER_NODE"),
    ({"SLURM_NTASKS_PER_NODE": "4"}, 4, "SLURM_NTASKS_PER_NODE"),     # the job's --ntasks-per-node
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "4"}, 8, "SLURM_GPUS_ON_NODE"),   # GPUs win
    ({"SLURM_GPUS_ON_NODE": "0"}, 1, "SLURM_NTASKS_PER_NODE"),
    ({"SLURM_NTASKS_PER_NODE": None}, 1, ""),
])
def test_workers_per_node_come_from_the_gpus_else_the_tasks_per_node(changes, workers, source):
    s = from_slurm_env(step(**changes))
    assert (s.workers_per_node, s.np_source) == (workers, source)


@pytest.mark.parametrize("changes", [
    {"SLURM_STEP_TASKS_PER_NODE": "2(x3)"},                                  # srun inherited --ntasks-per-node=2
    {"SLURM_STEP_TASKS_PER_NODE": "1,3,1"},                                  # this node (index 1) has 3
    {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_STEP_NUM_TASKS": "6"},          # 6 tasks on 3 nodes
])
def test_a_step_with_several_tasks_on_this_node_is_refused_with_the_fix(changes):
    with pytest.raises(SlurmEnvError, match=r"srun started \d tasks on node node2 .*srun --ntasks-per-node=1"):
        from_slurm_env(step(**changes))


def test_one_task_here_while_another_node_has_more_is_fine():
    assert from_slurm_env(step(SLURM_STEP_TASKS_PER_NODE="2,1,1")) is not None


@pytest.mark.parametrize("changes, message", [
    ({"SLURMD_NODENAME": None}, "SLURMD_NODENAME is not set"),
    ({"SLURM_GPUS_ON_NODE": "many"}, "SLURM_GPUS_ON_NODE='many' is not a non-negative whole number"),
    ({"SLURM_JOB_NODELIST": "node[1-"}, "SLURM_JOB_NODELIST='node[1-': unbalanced brackets"),
])
def test_a_broken_slurm_environment_is_refused_naming_the_variable(changes, message):
    with pytest.raises(SlurmEnvError, match=re.escape(message)):
        from_slurm_env(step(**changes))


# ---------------------------------------------------------------------- the flags it derives
def launch_env(tmp_path, **changes):
    env = step(HOME=str(tmp_path), ELASTIC_RING_HOST="127.0.0.1", **changes)
    return env


def cfg_under(tmp_path, *args, **changes):
    return parse([*args, "--", sys.executable, "-c", "pass"], env=launch_env(tmp_path, **changes))


def test_under_srun_the_job_host_np_and_min_np_come_from_slurm(tmp_path):
    cfg = cfg_under(tmp_path)
    assert (cfg.job_id, cfg.host, cfg.np, cfg.min_np, cfg.min_np_given) == ("4242", "node2", 1, 3, False)
    assert cfg.slurm_role == "member" and not cfg.embedded and cfg.connect_timeout == 60.0
    assert cfg.announce_dir == str(tmp_path / ".elastic-run" / "slurm-4242.0")
    cfg = cfg_under(tmp_path, "--np", "2", "--job-id", "exp", "--host", "h", "--min-np", "5", "--connect-timeout",
                    "5")
    assert (cfg.job_id, cfg.host, cfg.np, cfg.min_np, cfg.connect_timeout) == ("exp", "h", 2, 5, 5.0)
    assert cfg.announce_dir == str(tmp_path / ".elastic-run" / "slurm-4242.0-exp")
    assert cfg_under(tmp_path, SLURM_GPUS_ON_NODE="4").np == 4
    assert cfg_under(tmp_path, SLURM_GPUS_ON_NODE="4").min_np == 12


def test_the_batch_host_serves_on_its_cluster_address_and_the_others_join_it(tmp_path):
    head = cfg_under(tmp_path, SLURMD_NODENAME="node1")
    assert head.slurm_role == "head" and head.embedded and head.embedded_host == "127.0.0.1"
    assert stat.S_IMODE(os.stat(tmp_path / ".elastic-run").st_mode) == 0o700   # created private
    assert head.connect_timeout == 10.0
    # A requeued job (SLURM_RESTART_COUNT) gets a fresh announcement.
    assert cfg_under(tmp_path, SLURM_RESTART_COUNT="1").announce_dir.endswith("slurm-4242.1")


def test_with_rendezvous_or_on_one_node_nothing_is_announced(tmp_path):
    cfg = cfg_under(tmp_path, "--rendezvous", "10.0.0.1:29400")
    assert (cfg.slurm_role, cfg.job_id, cfg.announce_dir) == ("", "4242", None)   # no --job-id needed
    one = cfg_under(tmp_path, SLURM_JOB_NODELIST="node2", SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1",
                    SLURM_STEP_TASKS_PER_NODE="1", SLURM_NODEID="0")
    assert one.slurm_role == "" and one.embedded and one.embedded_host == "127.0.0.1" and one.min_np == 1


@pytest.mark.parametrize("args, changes, message", [
    (["--rendezvous-dir", "/tmp"], {"SLURM_STEP_ID": None}, "--rendezvous-dir is for elastic-run under srun"),
    (["--tls-ca", "/x"], {}, "--tls-ca needs --rendezvous: the embedded rendezvous server has no TLS"),
    ([], {"SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, "srun started 4 tasks on node node2"),
])
def test_bad_slurm_set_ups_are_one_line_usage_errors(tmp_path, args, changes, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg_under(tmp_path, *args, **changes)


def test_a_rendezvous_dir_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UsageError, match=r"can be written by other users.*chmod go-w"):
        cfg_under(tmp_path, "--rendezvous-dir", str(shared), SLURMD_NODENAME="node1")
    with pytest.raises(UsageError, match=r"can be written by other users"):
        cfg_under(tmp_path, "--rendezvous-dir", str(shared))   # a member checks it too


def test_serve_host_is_the_ring_host_else_a_non_loopback_address_of_the_name():
    assert serve_host("10.1.2.3", lambda: ("n", "")) == "10.1.2.3"
    assert serve_host("", lambda: ("n", "10.0.0.7")) == "10.0.0.7"
    for address, found in (("127.0.1.1", "resolves to 127.0.1.1, a loopback address"), ("", "does not resolve")):
        with pytest.raises(SlurmEnvError, match=re.escape(f"this node's name 'n' {found}") + ".*ELASTIC_RING_HOST"):
            serve_host("", lambda: ("n", address))


# ---------------------------------------------------------------------- the announcement
def slurm_step(**kw):
    return SlurmStep(**{"job_id": "7", "node": "n1", "job_nodes": ("n1", "n2"), "step_nodes": 2, "restart_count": 0,
                        "workers_per_node": 1, "np_source": "", **kw})


def test_an_announcement_is_private_and_read_back(tmp_path):
    base = tmp_path / "base"
    check_base_dir(str(base), create=True)
    directory = announcement_dir(str(base), slurm_step(), "7")
    a = Announcement(directory, "10.0.0.1:4000", "tok-1", alive=lambda *_: False)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(a.token_file).st_mode) == 0o600
    assert read_announcement(directory) == ("10.0.0.1:4000", "tok-1")
    assert wait_for_announcement(directory, "n1", 1.0) == ("10.0.0.1:4000", "tok-1")
    a.withdraw()
    assert not os.path.exists(directory)
    assert read_announcement(directory) is None


def test_waiting_for_an_announcement_that_never_comes_names_the_batch_host_and_the_fixes(tmp_path):
    with pytest.raises(SlurmEnvError, match=r"no rendezvous server announced in .* within 0.2 s by the elastic-run "
                                            r"of the batch host n1: run this step on n1 too"):
        wait_for_announcement(str(tmp_path / "none"), "n1", 0.2)
    assert wait_for_announcement(str(tmp_path / "none"), "n1", 30, cancelled=lambda: True) is None


def test_a_stale_announcement_is_replaced_and_a_live_one_refused(tmp_path):
    directory = str(tmp_path / "ann")
    Announcement(directory, "10.0.0.1:4000", "old", alive=lambda *_: False)   # left behind by a killed launcher
    probed = []
    Announcement(directory, "10.0.0.1:5000", "new", alive=lambda *a: probed.append(a) or False)
    assert probed == [("10.0.0.1:4000", "old")]
    assert read_announcement(directory) == ("10.0.0.1:5000", "new")
    with pytest.raises(SlurmEnvError, match=r"still answers \(10.0.0.1:5000\).*give this one another --job-id"):
        Announcement(directory, "10.0.0.1:6000", "other", alive=lambda *_: True)
    assert read_announcement(directory) == ("10.0.0.1:5000", "new")


def test_an_announcement_others_could_read_or_a_bad_address_is_refused(tmp_path):
    directory = tmp_path / "ann"
    Announcement(str(directory), "10.0.0.1:4000", "t", alive=lambda *_: False)
    directory.chmod(0o755)
    with pytest.raises(SlurmEnvError, match=r"is open to other users; it must be 0700"):
        read_announcement(str(directory))
    directory.chmod(0o700)
    (directory / "server").write_text("not an address\n")
    with pytest.raises(ValueError, match=r"is not HOST:PORT"):
        read_announcement(str(directory))
