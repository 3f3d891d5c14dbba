"""An FSDP2 job for the torch.distributed tests: one model trained side by side over torch's gloo
and over the elastic group, in the same worker processes, on the same batches; run as a worker
process with ELASTIC_* set (ELASTIC_DEFAULT_GROUP=0: the script makes gloo the default group).

Knobs (environment): JOB_OUT (directory), JOB_STEPS (default 5).

Every step each worker appends to events-<worker>.jsonl the full parameters of both models
(``full_tensor()``, each over its own group) and how many of each ring collective the elastic
model's step ran; at the end result-<worker>.json holds both models' full state dicts from
torch.distributed.checkpoint's ``get_model_state_dict``/``get_optimizer_state_dict``. The model,
batches and step are defined here for the tests' single-process reference too.
"""

from __future__ import annotations

import collections
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import elastic

# Dimensions that the world sizes of the tests (2, 3) do not all divide: FSDP2 pads the last shard.
DIMS = (9, 15, 13, 5)
LR = 1e-2
CLIP = 0.5


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.Tanh()] if i < len(DIMS) - 2 else [])
    return torch.nn.Sequential(*layers)


def shard(model: torch.nn.Module, mesh) -> None:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, DIMS[0], generator=g), torch.randn(4, DIMS[-1], generator=g)


def train_step(model, opt, x, y) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad()


def reference(size: int, steps: int):
    """One process trained on the global batches (every rank's, in rank order): each step's
    parameters, and the optimizer's state at the end (indexed like the model's parameters)."""
    model = build()
    opt = optimizer(model)
    out = []
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(size)))
        train_step(model, opt, torch.cat(xs), torch.cat(ys))
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out, opt.state_dict()


def _lists(sd: dict) -> dict:
    return {k: v.detach().double().reshape(-1).tolist() for k, v in sd.items()}


class _RingCalls:
    """Counts the ring collectives the elastic group runs (the communicator's public calls)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        for name in ("allreduce_", "allgather_into_", "reduce_scatter_", "broadcast_"):
            real = getattr(elastic.Communicator, name)

            def counted(comm, *args, _real=real, _name=name, **kwargs):
                self.counts[_name] += 1
                return _real(comm, *args, **kwargs)
            setattr(elastic.Communicator, name, counted)

    def take(self) -> dict:
        taken = dict(self.counts)
        self.counts.clear()
        return taken


def main() -> None:
    torch.set_num_threads(1)
    out, worker = os.environ["JOB_OUT"], os.environ["ELASTIC_WORKER_ID"]
    steps = int(os.environ.get("JOB_STEPS", "5"))
    calls = _RingCalls()
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        rank, size = elastic.rank(), elastic.size()
        # gloo as torch's default group, over a store rank 0 hosts (its port goes round the ring).
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=rank == 0, wait_for_workers=False) if rank == 0 else None
        port = elastic.broadcast_object(store.port if store is not None else None, root_rank=0)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        models = {"gloo": build(), "elastic": build()}
        shard(models["gloo"], init_device_mesh("cpu", (size,)))
        shard(models["elastic"], elastic.device_mesh())
        opts = {k: optimizer(m) for k, m in models.items()}
        with open(os.path.join(out, f"events-{worker}.jsonl"), "w") as events:
            for step in range(steps):
                x, y = batch(step, rank)
                rec = {"step": step, "rank": rank, "size": size}
                for kind in ("gloo", "elastic"):
                    calls.take()
                    train_step(models[kind], opts[kind], x, y)
                    rec[f"{kind} ring calls"] = calls.take()
                    rec[kind] = _lists({k: v.full_tensor() for k, v in models[kind].state_dict().items()})
                events.write(json.dumps(rec) + "\n")
        options = StateDictOptions(full_state_dict=True)
        result = {"rank": rank}
        for kind, model in models.items():
            osd = get_optimizer_state_dict(model, opts[kind], options=options)
            result[kind] = {"model": _lists(get_model_state_dict(model, options=options)),
                            "exp_avg": _lists({n: s["exp_avg"] for n, s in osd["state"].items()}),
                            "exp_avg_sq": _lists({n: s["exp_avg_sq"] for n, s in osd["state"].items()})}
        dist.destroy_process_group()
        with open(os.path.join(out, f"result-{worker}.json"), "w") as f:
            json.dump(result, f)

    train(state)


if __name__ == "__main__":
    main()
