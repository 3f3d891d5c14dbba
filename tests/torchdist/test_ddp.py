"""elastic.DistributedDataParallel in real worker processes against a real rendezvous server:
bit-for-bit against a hand-averaged replay, and across a SIGKILL mid-backward and a join."""

from __future__ import annotations

import importlib.util
from collections import defaultdict

import pytest
import torch

from tests.waiting import wait_until

from . import JOB_SCRIPT

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

_spec = importlib.util.spec_from_file_location("ddp_job_defs", JOB_SCRIPT)


def _job_module(monkeypatch):
    # The job script's model and batches, without running it (it reads these at import).
    monkeypatch.setenv("JOB_OUT", "/nonexistent")
    monkeypatch.setenv("ELASTIC_WORKER_ID", "reference")
    mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(mod)
    return mod


def replay(mod, kind: str, steps: int, size: int, accum: int = 1):
    """The fault-free job by hand: each rank's gradients on its own batches, summed and halved
    (two ranks: one addition, so any summation order gives these bits), then SGD; BatchNorm
    buffers are rank 0's before every forward, as DDP's broadcast_buffers makes them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nets = [mod.build(kind) for _ in range(size)]
        opts = [torch.optim.SGD(n.parameters(), lr=mod.LR) for n in nets]
        for step in range(steps):
            for o in opts:
                o.zero_grad()
            for micro in range(accum):
                rank0_buffers = [b.clone() for b in nets[0].buffers()]
                for rank, net in enumerate(nets):
                    for b, b0 in zip(net.buffers(), rank0_buffers):
                        b.copy_(b0)
                    x, y = mod.batch(step, rank, micro)
                    torch.nn.functional.mse_loss(net(x, rank=rank), y).backward()
            params = [list(n.parameters()) for n in nets]
            for i in range(len(params[0])):
                grads = [(p[i].grad if p[i].grad is not None else torch.zeros_like(p[i])) for p in params]
                avg = (grads[0] + grads[1]) / 2
                for p in params:
                    p[i].grad = avg.clone()
            for o in opts:
                o.step()
        return nets
    finally:
        torch.set_num_threads(threads)


def _as_lists(net):
    return {n: t.detach().double().reshape(-1).tolist()
            for n, t in list(net.named_parameters()) + list(net.named_buffers())}


CASES = {
    "plain": dict(JOB_MODEL="mlp"),
    "several buckets": dict(JOB_MODEL="mlp", JOB_BUCKET_MB="0.002"),
    "find_unused_parameters": dict(JOB_MODEL="unused"),
    "no_sync accumulation": dict(JOB_MODEL="mlp", JOB_ACCUM="3"),
    "buffers": dict(JOB_MODEL="bn"),
    "static_graph": dict(JOB_MODEL="mlp", JOB_STATIC="1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_matches_a_hand_averaged_replay_bitwise_on_every_rank(ddp_job, monkeypatch, case):
    env = CASES[case]
    steps = 6
    job = ddp_job(min_np=2, max_np=2, JOB_STEPS=str(steps), **env)
    workers = ["w0", "w1"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=120)
    assert codes == {"w0": 0, "w1": 0}, {w: job.log(w) for w in workers}
    mod = _job_module(monkeypatch)
    nets = replay(mod, env["JOB_MODEL"], steps, 2, int(env.get("JOB_ACCUM", "1")))
    for w in workers:
        res = job.result(w)
        expected = _as_lists(nets[res["rank"]])
        assert res["params"].keys() == expected.keys()
        for name, values in expected.items():
            assert res["params"][name] == values, f"{w} (rank {res['rank']}): {name} differs from the replay"


def _by_step(job, workers):
    """{(world version, step): {worker: digest}} from the workers' step records."""
    seen = defaultdict(dict)
    for w in workers:
        for rec in job.events(w):
            seen[(rec["version"], rec["step"])][w] = rec["digest"]
    return seen


def test_sigkill_mid_backward_survivors_keep_their_live_state_and_go_on_with_identical_replicas(ddp_job):
    # Small buckets: when the kill lands (in the last gradient of backward), earlier buckets
    # are already on the ring; the survivors' DDP must raise, not crash or hang.
    job = ddp_job(min_np=2, JOB_STEPS="30", JOB_BUCKET_MB="0.002", JOB_KILL="w2:9", JOB_COMMIT_EVERY="4",
                  JOB_STEP_SLEEP="0.02")
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=180)
    assert codes["w2"] == -9, job.log("w2")
    assert codes["w0"] == 0 and codes["w1"] == 0, job.log("w0") + job.log("w1")
    for w in ("w0", "w1"):
        log = job.log(w)
        # The failure surfaced in backward's allreduce, before any optimizer step: kept, not restored.
        assert "keeping the live state" in log and "restoring commit" not in log, log
        assert "WorkerLostError" not in log, log
        assert "Segmentation" not in log and "core dumped" not in log
    r0, r1 = job.result("w0"), job.result("w1")
    assert r0["digest"] == r1["digest"]
    assert r0["size"] == 2 and r0["version"] > 1
    # Nothing was redone: the survivors' first step in the new world is the one the kill
    # interrupted (9), not the one after the last commit (8).
    after = [rec for rec in job.events("w0") if rec["version"] == r0["version"]]
    assert after[0]["step"] == 9
    for (version, step), digests in _by_step(job, ["w0", "w1"]).items():
        if version == r0["version"]:
            assert len(set(digests.values())) == 1, f"replicas differ at step {step}: {digests}"


def test_a_kill_mid_backward_costs_only_that_step_bit_for_bit_with_batchnorm(ddp_job, monkeypatch):
    # Two workers with BatchNorm; w1 dies inside step 9's backward, after that step's forward
    # changed the running statistics. w0 keeps its live state (parameters of step 8's end,
    # buffers put back to theirs) and trains steps 9.. alone: exactly the fault-free replay of
    # steps 0-8 in a world of two, then 9-13 in a world of one. A restore (to the commit at
    # step 8) or buffers left as the failed forward made them would change these bits.
    steps, kill = 14, 9
    job = ddp_job(min_np=1, max_np=2, JOB_MODEL="bn", JOB_STEPS=str(steps), JOB_KILL=f"w1:{kill}",
                  JOB_COMMIT_EVERY="4", JOB_START_SIZE="2")
    for w in ("w0", "w1"):
        job.start(w)
    codes = job.wait(["w0", "w1"], timeout=180)
    assert codes == {"w0": 0, "w1": -9}, job.log("w0") + job.log("w1")
    log = job.log("w0")
    assert "keeping the live state" in log and "restoring commit" not in log, log
    events = job.events("w0")
    assert [rec["step"] for rec in events] == list(range(steps)), "every step once"
    assert {rec["size"] for rec in events if rec["step"] < kill} == {2}
    assert {rec["size"] for rec in events if rec["step"] >= kill} == {1}
    old_rank = next(rec["rank"] for rec in events if rec["step"] == kill - 1)
    mod = _job_module(monkeypatch)
    net = replay(mod, "bn", kill, 2)[old_rank]
    opt = torch.optim.SGD(net.parameters(), lr=mod.LR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(kill, steps):
            opt.zero_grad()
            x, y = mod.batch(step, 0, 0)
            torch.nn.functional.mse_loss(net(x, rank=0), y).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    res = job.result("w0")
    expected = _as_lists(net)
    assert res["params"].keys() == expected.keys()
    for name, values in expected.items():
        assert res["params"][name] == values, f"{name} differs from the replay without a redo"


JOINS = {
    "plain": {},
    # A fresh reducer of a static graph must run its first iteration's delayed allreduce again.
    "static_graph": dict(JOB_STATIC="1"),
    # Two DDPs of equal shapes the state does not hold: synced by elastic.run, in one order.
    "two DDPs outside the state": dict(JOB_OUTSIDE="1"),
}


@pytest.mark.parametrize("case", list(JOINS))
def test_a_joiner_gets_the_state_and_every_rank_reduces_the_same_buckets(ddp_job, case):
    # Survivors have rebuilt their buckets (in gradient-ready order) long before the joiner
    # arrives; if they kept them, the first step of the new world would reduce different
    # parameters in the same slots and the replicas would part at once.
    job = ddp_job(min_np=2, JOB_STEPS="12", JOB_COMMIT_EVERY="2", JOB_STEP_SLEEP="0.05", JOB_UNTIL_SIZE="3",
                  **JOINS[case])
    for w in ("w0", "w1"):
        job.start(w)
    job.wait_step(8, ["w0", "w1"], timeout=90)
    job.start("w2")
    workers = ["w0", "w1", "w2"]
    codes = job.wait(workers, timeout=180)
    assert codes == {"w0": 0, "w1": 0, "w2": 0}, {w: job.log(w) for w in workers}
    results = [job.result(w) for w in workers]
    assert {r["digest"] for r in results} == {results[0]["digest"]}
    assert {r["size"] for r in results} == {3}
    steps_of_three = 0
    for (version, step), digests in _by_step(job, workers).items():
        assert len(set(digests.values())) == 1, f"world {version} step {step}: replicas differ: {digests}"
        if len(digests) == 3:
            steps_of_three += 1
    assert steps_of_three >= 2, "the joiner trained in no world of three"
    assert "restoring" not in job.log("w0"), "a clean join must not restore"


def test_dist_calls_and_torchmetrics_follow_a_world_that_shrinks_and_grows(ddp_job):
    # Every step checks dist.get_rank/get_world_size, all_reduce, all_gather, broadcast,
    # async all_reduce and barrier on the default group, and computes a torchmetrics
    # SumMetric of (rank + 1) that torchmetrics itself gathers through torch.distributed.
    job = ddp_job(min_np=2, JOB_STEPS="16", JOB_COMMIT_EVERY="2", JOB_STEP_SLEEP="0.05", JOB_DIST="1",
                  JOB_METRIC="1", JOB_UNTIL_SIZE="3")
    for w in ("w0", "w1", "w2"):
        job.start(w)
    job.wait_step(4, ["w0", "w1", "w2"], timeout=90)
    job.kill("w2")
    wait_until(lambda: (job.progress("w0") or (0, 0, 0))[1] == 2, 60, "the world to shrink to 2")
    job.start("w3")
    workers = ["w0", "w1", "w3"]
    codes = job.wait(workers, timeout=180)
    assert codes == {"w0": 0, "w1": 0, "w3": 0}, {w: job.log(w) for w in workers}
    for w in workers + ["w2"]:
        for rec in job.events(w):
            assert all(rec["dist"].values()), f"{w} step {rec['step']} world {rec['version']}: {rec['dist']}"
            n = rec["size"]
            assert rec["metric"] == n * (n + 1) / 2, f"{w}: torchmetrics summed {rec['metric']} in a world of {n}"
    by_version = {}
    for rec in job.events("w0"):
        by_version.setdefault(rec["version"], rec["size"])
    # A world of three (the first, or the second when w2 came after the settle window), of two
    # after the kill, of three again with w3.
    assert list(by_version.values())[-3:] == [3, 2, 3], by_version
    assert all(job.result(w)["dist_initialized"] for w in workers)
