"""FSDP2 on the elastic group in real worker processes against a real rendezvous server: the same
model trained over gloo in the same processes, and in one process on the global batches, agrees
step by step; its gradients travel as ring reduce-scatters and its parameters as ring allgathers."""

from __future__ import annotations

import os

import torch

from . import fsdp_job
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_job.py")
STEPS = 5


def _tensors(lists: dict) -> dict:
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in lists.items()}


def _differ(got: dict, want: dict) -> dict:
    """{name: max abs difference} where two state dicts part beyond float32 tolerance."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {k: (got[k] - want[k].double().reshape(-1)).abs().max().item() for k in want
            if not torch.allclose(got[k], want[k].double().reshape(-1), rtol=1e-4, atol=1e-6)}


def test_fsdp2_over_the_elastic_group_matches_gloo_and_one_process_every_step(job_factory):
    job = job_factory(script=SCRIPT, min_np=2, max_np=2, JOB_STEPS=str(STEPS), ELASTIC_DEFAULT_GROUP="0")
    workers = ["w0", "w1"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers, timeout=180)
    assert codes == {"w0": 0, "w1": 0}, {w: job.log(w) for w in workers}

    want_steps, want_opt = fsdp_job.reference(2, STEPS)
    names = list(want_steps[0])
    linears = sum(isinstance(m, torch.nn.Linear) for m in fsdp_job.build())
    for w in workers:
        events = job.events(w)
        assert [e["step"] for e in events] == list(range(STEPS)), job.log(w)
        for e in events:
            at = f"{w} (rank {e['rank']}) step {e['step']}"
            elastic_full, gloo_full = _tensors(e["elastic"]), _tensors(e["gloo"])
            assert not _differ(elastic_full, gloo_full), f"{at}: elastic and gloo differ"
            assert not _differ(elastic_full, want_steps[e["step"]]), f"{at}: elastic and one process differ"
            # One reduce-scatter per FSDP unit for the gradients, one allreduce (clip_grad_norm_'s
            # norm); the parameters come by allgather (forward, backward, full_tensor): none of it
            # is built from allreduce. The gloo model's step runs nothing on the ring.
            ring = e["elastic ring calls"]
            assert ring.get("reduce_scatter_") == linears, (at, ring)
            assert ring.get("allreduce_") == 1, (at, ring)
            assert ring.get("allgather_into_", 0) >= 2 * linears, (at, ring)
            assert e["gloo ring calls"] == {}, (at, e["gloo ring calls"])
        result = job.result(w)
        for kind in ("elastic", "gloo"):
            assert not _differ(_tensors(result[kind]["model"]), want_steps[-1]), f"{w} {kind}: get_model_state_dict"
            for key in ("exp_avg", "exp_avg_sq"):
                got = _tensors(result[kind][key])
                want = {name: want_opt["state"][i][key] for i, name in enumerate(names)}
                assert not _differ(got, want), f"{w} {kind}: get_optimizer_state_dict {key}"
    assert "StaleMeshError" not in job.log("w0") + job.log("w1")
