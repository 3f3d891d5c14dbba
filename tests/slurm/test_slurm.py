"""elastic-run under a real Slurm (tests/slurm/cluster.py): sbatch, srun, node failures, scancel.

Each job runs one elastic-run per node under srun, as examples/slurm/train.sbatch does; the batch
host's (node1's) serves the rendezvous and announces it in the test's --rendezvous-dir. What is
checked comes from Slurm (scontrol) and from the launchers' and workers' own lines in the job's
output, never from timing alone.
"""

from __future__ import annotations

import os
import re
import sys
import time

from tests.waiting import wait_until
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "launch", "worker.py")
EXAMPLE = os.path.join(REPO, "examples", "slurm", "train.sbatch")
JOB_TIMEOUT_S = 120


def job_env(tmp_path, **extra):
    """What sbatch passes on to the job (it exports the submitter's environment)."""
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "HOME": str(tmp_path),
            "LW_OUT": str(tmp_path), "ELASTIC_WORLD_TIMEOUT": "60", "ELASTIC_COLLECTIVE_TIMEOUT": "20", **extra}


def write_job(tmp_path, name, body, *sbatch):
    """A batch script running `body` (one srun line per step) with the launcher and worker of this repo."""
    path = tmp_path / f"{name}.sh"
    directives = "".join(f"#SBATCH {d}\n" for d in (f"--output={tmp_path}/{name}.out", *sbatch))
    launcher = f"{sys.executable} -u -m elastic.launch --rendezvous-dir {tmp_path}/rdv"
    path.write_text("#!/bin/bash\n" + directives + "set -u\n"
                    + body.format(launch=launcher, worker=f"-- {sys.executable} -u {WORKER}")
                    + "\necho \"batch script: srun status $?\"\n")
    return str(path)


def output(tmp_path, name):
    path = tmp_path / f"{name}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_output(tmp_path, name, pattern, timeout=JOB_TIMEOUT_S):
    """The first match of `pattern` in the job's output, waiting for it to be written."""
    rx = re.compile(pattern, re.M)
    return wait_until(lambda: rx.search(output(tmp_path, name)), timeout,
                      f"{pattern!r} in {name}.out:\n{output(tmp_path, name)[-3000:]}")


def steps_by_worker(text):
    """worker id -> the step numbers its "step S size N" lines printed, in order (tests/launch/worker.py)."""
    steps = {}
    for m in re.finditer(r"^\[(\S+)\] step (\d+) size (\d+)$", text, re.M):
        steps.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3))))
    return steps


def ranks_in_first_world(text):
    return dict(re.findall(r"^\[(\S+)\] INFO elastic: worker \S+ is rank (\d+) of \d+ in world version 1\b", text,
                           re.M))


# ---------------------------------------------------------------------- the example script, as users run it
def test_the_example_sbatch_trains_on_three_nodes_with_a_hot_spare_on_standby(slurm, tmp_path):
    job = slurm.sbatch(EXAMPLE, "--chdir", REPO, f"--output={tmp_path}/example.out", "--time=10",
                       args=("--epochs", "3", "--step-sleep", "0.01"),
                       **job_env(tmp_path, CHECKPOINTS=str(tmp_path / "ckpt")))
    wait_output(tmp_path, "example", r"world version 1: training on 3 worker\(s\)")
    # While it runs, Slurm sees what an admin expects: one step, one task (an elastic-run) per
    # node, and the workers inside the step (so scancel and the job's end reach them).
    step = wait_until(lambda: [s for s in slurm.steps(job) if s["StepId"] == f"{job}.0"], 30, "step 0")[0]
    assert step["NodeList"] == "node[1-4]" and step["Tasks"] == "4", step
    workers = wait_until(lambda: slurm.processes("node2", "train_linear.py"), 30, "node2's worker")
    listed = slurm.on_node("node2", "scontrol", "listpids", f"{job}.0").stdout
    assert set(workers) <= {int(p) for p in re.findall(r"^(\d+)\s", listed, re.M)}, (workers, listed)
    info = slurm.wait_job(job, ("COMPLETED", "FAILED"), JOB_TIMEOUT_S)
    text = output(tmp_path, "example")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert info["Restarts"] == "0" and info["BatchHost"] == "node1", info
    assert re.search(r"job \d+ run 0 on node\[1-4\]: 3 workers train, 1 node\(s\) spare", text)
    errors = dict(re.findall(r"^\[(node\d-0)\] done in [0-9.]+ s: max \|w - w_true\| = ([0-9.]+)$", text, re.M))
    assert all(float(errors[w]) < 0.05 for w in ranks_in_first_world(text)), errors   # they learned
    spares = set(re.findall(r"^\[(node\d-0)\] INFO elastic: worker \S+ on standby: beyond max_np", text, re.M))
    assert len(spares) == 1 and not spares & set(ranks_in_first_world(text)), text[-3000:]   # it waited
    assert text.count("elastic-run: job {} completed".format(job)) == 4, text[-3000:]
    assert re.search(rf"job {job} completed$", text, re.M)            # the script's own last word



def check_steps_only_go_forward(steps, workers):
    """Each worker's steps run 1, 2, 3, ... with none repeated: nothing was restored and redone."""
    for w in workers:
        numbers = [s for s, _ in steps[w]]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), f"{w} redid steps: {numbers}"


# ---------------------------------------------------------------------- node failure, spare, preemption
ONE_STEP = ("srun --ntasks-per-node=1 --no-kill --kill-on-bad-exit=0 {launch} --max-restarts 0 {args} {worker}")


def test_a_failed_node_leaves_the_survivors_training_in_a_smaller_world_and_the_job_completes(slurm, tmp_path):
    script = write_job(tmp_path, "fail", ONE_STEP.replace("{args}", "--min-np 2"), "--nodes=3", "--ntasks-per-node=1",
                       "--no-kill")
    job = slurm.sbatch(script, **job_env(tmp_path, LW_STEPS="150", LW_SLEEP="0.05"))
    wait_until(lambda: all(len([s for s in v if s[1] == 3]) >= 5 for v in steps_by_worker(output(tmp_path, "fail"))
                           .values()) and len(steps_by_worker(output(tmp_path, "fail"))) == 3, JOB_TIMEOUT_S,
               "three nodes training together")
    slurm.fail_node("node3")
    info = slurm.wait_job(job, ("COMPLETED", "FAILED"), JOB_TIMEOUT_S)
    text = output(tmp_path, "fail")
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert "srun: error: Node failure on node3" in text                    # Slurm saw it as a node failure
    assert info["NodeList"] == "node[1-2]", info                         # --no-kill: the job kept the others
    assert slurm.node_states()["node3"].startswith("down"), slurm.node_states()
    steps = steps_by_worker(text)
    for w in ("node1-0", "node2-0"):
        sizes = [size for i, (_, size) in enumerate(steps[w]) if i == 0 or steps[w][i - 1][1] != size]
        # --min-np 2 lets the first two nodes start before the third's task is up: a world of 2 may come first
        assert sizes in ([3, 2], [2, 3, 2]) and steps[w][-1][0] == 150, f"{w}: {sizes}, {steps[w][-5:]}"
    assert text.count(f"elastic-run: job {job} completed") == 2, text[-3000:]
    assert "batch script: srun status 0" in text                          # the lost node's task counts for nothing


def test_a_hot_spare_node_joins_when_a_node_is_lost(slurm, tmp_path):
    script = write_job(tmp_path, "spare", ONE_STEP.replace("{args}", "--min-np 3 --max-np 3"), "--nodes=4",
                       "--ntasks-per-node=1", "--no-kill")
    job = slurm.sbatch(script, **job_env(tmp_path, LW_STEPS="150", LW_SLEEP="0.05"))
    spare = wait_output(tmp_path, "spare", r"^\[(node\d-0)\] INFO elastic: worker \S+ on standby: beyond max_np")[1]
    wait_until(lambda: len(ranks_in_first_world(output(tmp_path, "spare"))) == 3, 30, "the first world's ranks")
    trained = steps_by_worker(output(tmp_path, "spare"))
    assert spare not in trained
    victim = next(w for w in ranks_in_first_world(output(tmp_path, "spare")) if w != "node1-0").split("-")[0]
    wait_until(lambda: len(steps_by_worker(output(tmp_path, "spare")).get(f"{victim}-0", [])) >= 5, 30,
               f"{victim} training")
    slurm.fail_node(victim)
    info = slurm.wait_job(job, ("COMPLETED", "FAILED"), JOB_TIMEOUT_S)
    text = output(tmp_path, "spare")
    assert info["JobState"] == "COMPLETED", text[-3000:]
    steps = steps_by_worker(text)
    assert steps[spare][-1] == (150, 3), steps                           # the spare trained to the end
    survivors = [w for w in ranks_in_first_world(text) if not w.startswith(victim)]
    for w in survivors:
        assert steps[w][-1] == (150, 3), f"{w}: {steps[w][-5:]}"              # back to three, with the spare


def test_scancel_signal_term_to_one_nodes_step_is_a_graceful_leave_and_nothing_is_redone(slurm, tmp_path):
    # Two steps: node1 and node2 in one, node3 alone in the other (a node's own step can be signalled).
    body = ("srun --nodes=2 --ntasks=2 --nodelist=node[1-2] {launch} --min-np 2 {worker} &\n"
            "pair=$!\n"
            "srun --nodes=1 --nodelist=node3 --ntasks=1 {launch} --min-np 2 {worker} &\n"
            "alone=$!\n"
            "wait $pair; echo \"node1-2 step: status $?\"; wait $alone; echo \"node3 step: status $?\"")
    script = write_job(tmp_path, "term", body, "--nodes=3", "--ntasks-per-node=1")
    job = slurm.sbatch(script, **job_env(tmp_path, LW_STEPS="150", LW_SLEEP="0.05"))
    wait_until(lambda: sum(1 for _, size in steps_by_worker(output(tmp_path, "term")).get("node3-0", []) if size == 3)
               >= 5, JOB_TIMEOUT_S, "node3 training in the world of three")
    # Which step is whose: the two sruns start together, so their step ids come in either order.
    steps = {s["NodeList"]: s["StepId"] for s in slurm.steps(job)}
    assert set(steps) == {"node[1-2]", "node3", "node1"}, steps           # node1 also runs the batch step
    node3_step = steps["node3"]
    # Slurm 22.05's scancel delivers a step's signal (to every process of the step, launcher and
    # worker alike) and still exits 225, "Invalid job id specified": what counts is what arrives.
    slurm.run("scancel", "--signal=TERM", node3_step, check=False)
    info = slurm.wait_job(job, ("COMPLETED", "FAILED"), JOB_TIMEOUT_S)
    text = output(tmp_path, "term")
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert re.search(r"^elastic-run: worker node3-0 \(rank \d\) left \(preempted: SIGTERM to elastic-run\)$", text,
                     re.M), text[-3000:]
    assert re.search(rf"^elastic-run: every worker left job {job} gracefully on SIGTERM; it goes on without host "
                     r"node3$", text, re.M), text[-3000:]
    assert "node3 step: status 0" in text and "node1-2 step: status 0" in text, text[-3000:]
    steps = steps_by_worker(text)
    check_steps_only_go_forward(steps, ["node1-0", "node2-0", "node3-0"])
    for w in ("node1-0", "node2-0"):
        assert steps[w][-1] == (150, 2), f"{w}: {steps[w][-5:]}"               # they finished without node3
    assert steps["node3-0"][-1][0] < 150


# ---------------------------------------------------------------------- requeue
def test_the_example_requeues_a_job_whose_world_fell_below_min_np_and_the_next_run_resumes(slurm, tmp_path):
    job = slurm.sbatch(EXAMPLE, "--chdir", REPO, "--nodes=3", f"--output={tmp_path}/requeue.out", "--time=10",
                       args=("--epochs", "12", "--step-sleep", "0.03"),
                       **job_env(tmp_path, SPARES="0", MAX_REQUEUES="1", BELOW_MIN_TIMEOUT="3",
                                 CHECKPOINTS=str(tmp_path / "ckpt")))
    wait_output(tmp_path, "requeue", r"^\[node\d-0\] epoch 3: loss")              # rank 0, past a durable commit
    slurm.fail_node("node2")
    info = slurm.wait_job(job, "COMPLETED", 3 * JOB_TIMEOUT_S)
    text = output(tmp_path, "requeue")
    assert info["Restarts"] == "1", info
    assert re.search(r"elastic-run: error: job \d+ failed: only 2 eligible worker\(s\), below min_np=3", text)
    assert re.search(rf"job {job} stopped \(status 3\): requeued, run 1 of at most 1 resumes from ", text), text[-3000:]
    resumed = re.search(r"job \d+ run 1 on (\S+): 3 workers train[\s\S]*?world version 1: training on 3 worker\(s\) "
                        r"from epoch (\d+), batch (\d+)", text)
    assert resumed and "node2" not in resumed.group(1), text[-4000:]
    assert int(resumed.group(2)) >= 1, resumed.group(0)                   # from the durable commit, not from scratch
    assert re.search(rf"job {job} completed$", text, re.M), text[-3000:]
