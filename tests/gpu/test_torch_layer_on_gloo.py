"""The torch layer's own jobs (tests/torchdist) with their collectives on the world's device
communicator, gloo standing in for NCCL: DDP bit for bit against a hand-averaged replay, a
SIGKILL mid-backward that keeps the live state (nothing redone), and FSDP2 matching gloo and one
process with none of its collectives on the ring."""

from __future__ import annotations

import pytest

from tests.elastic.conftest import job_factory, server  # noqa: F401  (the runtime tests' server and jobs)
from tests.torchdist import JOB_SCRIPT, fsdp_job
from tests.torchdist.test_ddp import CASES, _as_lists, _job_module, replay
from tests.torchdist.test_fsdp import SCRIPT as FSDP_SCRIPT, _differ, _tensors

pytestmark = pytest.mark.slow   # real processes and a real rendezvous server

ON_GLOO = {"ELASTIC_DEVICE_BACKEND": "gloo", "ELASTIC_LOG_LEVEL": "INFO"}   # INFO: the made and aborted lines


@pytest.mark.parametrize("case", ["several buckets", "buffers"])
def test_ddp_on_the_device_communicator_matches_a_hand_averaged_replay_bitwise(job_factory, monkeypatch, case):  # noqa: F811
    env = CASES[case]
    steps = 6
    job = job_factory(script=JOB_SCRIPT, min_np=2, max_np=2, JOB_STEPS=str(steps), **env, **ON_GLOO)
    workers = ["w0", "w1"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=120)
    assert codes == {"w0": 0, "w1": 0}, {w: job.log(w) for w in workers}
    assert all("device backend gloo of world version" in job.log(w) for w in workers)
    nets = replay(_job_module(monkeypatch), env["JOB_MODEL"], steps, 2, int(env.get("JOB_ACCUM", "1")))
    for w in workers:
        res = job.result(w)
        for name, values in _as_lists(nets[res["rank"]]).items():
            assert res["params"][name] == values, f"{w} (rank {res['rank']}): {name} differs from the replay"


def test_a_sigkill_mid_backward_on_the_device_communicator_keeps_the_live_state(job_factory):  # noqa: F811
    job = job_factory(script=JOB_SCRIPT, min_np=2, JOB_STEPS="30", JOB_BUCKET_MB="0.002", JOB_KILL="w2:9",
                      JOB_COMMIT_EVERY="4", JOB_STEP_SLEEP="0.02", **ON_GLOO)
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=180)
    assert codes["w2"] == -9 and codes["w0"] == 0 and codes["w1"] == 0, job.log("w0") + job.log("w1")
    for w in ("w0", "w1"):
        log = job.log(w)
        assert "keeping the live state" in log and "restoring commit" not in log, log
        assert "aborted in" in log, log   # the world's gloo communicator, aborted on the failure
    r0, r1 = job.result("w0"), job.result("w1")
    assert r0["digest"] == r1["digest"] and r0["size"] == 2
    after = [rec for rec in job.events("w0") if rec["version"] == r0["version"]]
    assert after[0]["step"] == 9   # the step the kill interrupted: nothing redone


def test_fsdp2_on_the_device_communicator_matches_gloo_and_one_process(job_factory):  # noqa: F811
    steps = 5
    job = job_factory(script=FSDP_SCRIPT, min_np=2, max_np=2, JOB_STEPS=str(steps), ELASTIC_DEFAULT_GROUP="0",
                      **ON_GLOO)
    workers = ["w0", "w1"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=180)
    assert codes == {"w0": 0, "w1": 0}, {w: job.log(w) for w in workers}
    want_steps, _ = fsdp_job.reference(2, steps)
    for w in workers:
        events = job.events(w)
        assert [e["step"] for e in events] == list(range(steps)), job.log(w)
        for e in events:
            at = f"{w} (rank {e['rank']}) step {e['step']}"
            assert not _differ(_tensors(e["elastic"]), want_steps[e["step"]]), f"{at}: elastic and one process differ"
            # FSDP2's gathers, reduce-scatters and clip_grad_norm_'s allreduce all ran on gloo.
            assert e["elastic ring calls"] == {}, (at, e["elastic ring calls"])
        assert not _differ(_tensors(job.result(w)["elastic"]["model"]), want_steps[-1]), w
