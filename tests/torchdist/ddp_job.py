"""A DDP training job for the torch.distributed tests; run as a worker process with ELASTIC_* set.

Knobs (environment):
  JOB_OUT          directory for progress-<worker>.txt, events-<worker>.jsonl, result-<worker>.json
  JOB_STEPS        optimizer steps (default 20); JOB_COMMIT_EVERY commit every N steps (default 2)
  JOB_MODEL        "mlp" (default), "unused" (a head only odd ranks use; find_unused_parameters)
                   or "bn" (BatchNorm buffers, broadcast by DDP every forward)
  JOB_ACCUM        micro-batches per step, all but the last under no_sync() (default 1)
  JOB_BUCKET_MB    DDP's bucket_cap_mb (default 25)
  JOB_STEP_SLEEP   seconds per step (default 0)
  JOB_KILL         "WORKER:STEP": that worker SIGKILLs itself inside backward at that step,
                   after some gradient buckets are already in flight
  JOB_DIST         1: every step also checks dist.* on the default group against the world
  JOB_METRIC       1: every step a torchmetrics SumMetric of (rank + 1) is computed over the world
  JOB_STATIC       1: static_graph=True
  JOB_OUTSIDE      1: the state holds no module; a second DDP of the same shape trains beside the
                   first, and elastic.run must sync both itself, each from its own kind
  JOB_UNTIL_SIZE   N: after JOB_STEPS, go on until 5 steps in a row ran in a world of N or more (a joiner
                   has time to arrive; the count is state, so every rank stops at the same step)
  JOB_START_SIZE   N: train only from a world of N on (a smaller first world waits at commit
                   boundaries for the later workers to join)

The batch of a step is a function of (step, rank, micro-batch) only, so a test can replay a
fault-free job by hand. Every step appends a JSON line (step, world version, size, rank, and a
digest of parameters and buffers) to events-<worker>.jsonl.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import elastic

OUT = os.environ["JOB_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
STEPS = int(os.environ.get("JOB_STEPS", "20"))
COMMIT_EVERY = int(os.environ.get("JOB_COMMIT_EVERY", "2"))
MODEL = os.environ.get("JOB_MODEL", "mlp")
ACCUM = int(os.environ.get("JOB_ACCUM", "1"))
BUCKET_MB = float(os.environ.get("JOB_BUCKET_MB", "25"))
STEP_SLEEP = float(os.environ.get("JOB_STEP_SLEEP", "0"))
KILL = os.environ.get("JOB_KILL", "")
CHECK_DIST = os.environ.get("JOB_DIST") == "1"
METRIC = os.environ.get("JOB_METRIC") == "1"
STATIC = os.environ.get("JOB_STATIC") == "1"
OUTSIDE = os.environ.get("JOB_OUTSIDE") == "1"
UNTIL_SIZE = int(os.environ.get("JOB_UNTIL_SIZE", "0"))
START_SIZE = int(os.environ.get("JOB_START_SIZE", "0"))
LR = 2.0 ** -4


class Net(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.l1 = torch.nn.Linear(8, 32)
        self.bn = torch.nn.BatchNorm1d(32) if kind == "bn" else None
        self.l2 = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 4)
        self.extra = torch.nn.Linear(32, 4) if kind == "unused" else None

    def forward(self, x, rank: int = 0):
        h = torch.relu(self.l1(x))
        if self.bn is not None:
            h = self.bn(h)
        h = torch.relu(self.l2(h))
        out = self.head(h)
        if self.extra is not None and rank % 2 == 1:
            out = out + self.extra(h)
        return out


def build(kind: str = MODEL) -> Net:
    torch.manual_seed(0)
    return Net(kind)


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(step * 10_000 + rank * 100 + micro)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_dist() -> dict:
    """dist.* on the default group against the world elastic says this is."""
    size, rank = elastic.size(), elastic.rank()
    got = {"size_ok": dist.get_world_size() == size and dist.get_rank() == rank}
    t = torch.ones(3)
    dist.all_reduce(t)
    got["all_reduce"] = t.tolist() == [float(size)] * 3
    parts = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(parts, torch.tensor([rank, rank * 10]))
    got["all_gather"] = [p.tolist() for p in parts] == [[r, r * 10] for r in range(size)]
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=size - 1)
    got["broadcast"] = b.item() == float(size - 1)
    w = dist.all_reduce(torch.tensor([rank + 1.0]), op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    dist.barrier()
    got["is_initialized"] = dist.is_initialized()
    return got


def main() -> None:
    torch.set_num_threads(1)
    net = build()
    model = elastic.DistributedDataParallel(net, bucket_cap_mb=BUCKET_MB, static_graph=STATIC,
                                            find_unused_parameters=(MODEL == "unused"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    twin = twin_model = None
    if OUTSIDE:
        # Same shapes as net: if the ranks synced the two in different orders, they would swap
        # weights without any error.
        twin = build()
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(-1)
        twin_model = elastic.DistributedDataParallel(twin, bucket_cap_mb=BUCKET_MB)
        opt = torch.optim.SGD(list(model.parameters()) + list(twin_model.parameters()), lr=LR)
        state = elastic.TorchState(optimizer=opt, step=0, big=0)
    else:
        state = elastic.TorchState(model=net, optimizer=opt, step=0, big=0)
    metric = None
    if METRIC:
        import torchmetrics
        metric = torchmetrics.SumMetric()
    if KILL:
        who, at = KILL.split(":")
        if who == WORKER:
            def die(grad):
                if state.step == int(at):
                    os.kill(os.getpid(), signal.SIGKILL)
                return grad
            net.l1.weight.register_hook(die)   # computed last in backward: later buckets are in flight
    events = open(os.path.join(OUT, f"events-{WORKER}.jsonl"), "a")

    started = time.monotonic()

    def more() -> bool:
        if state.step < STEPS:
            return True
        if UNTIL_SIZE and state.big < 5:
            if time.monotonic() - started > 120:
                raise RuntimeError(f"no world of {UNTIL_SIZE} within 120 s")
            return True
        return False

    @elastic.run
    def train(state):
        deadline = time.monotonic() + 120
        while state.step == 0 and elastic.size() < START_SIZE:
            # The first world may be smaller (a later worker still starting): wait at commit
            # boundaries until it joins, then train from step 0 in the full world.
            if time.monotonic() > deadline:
                raise RuntimeError(f"no world of {START_SIZE} within 120 s")
            time.sleep(0.05)
            state.check_membership()
        while more():
            rank = elastic.rank()
            opt.zero_grad()
            for micro in range(ACCUM):
                ctx = model.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext()
                with ctx:
                    x, y = batch(state.step, rank, micro)
                    torch.nn.functional.mse_loss(model(x, rank=rank), y).backward()
                    if twin_model is not None:
                        torch.nn.functional.mse_loss(twin_model(x, rank=rank), -y).backward()
            opt.step()
            rec = {"step": state.step, "version": elastic.world_version(), "size": elastic.size(), "rank": rank,
                   "digest": digest(net) + (digest(twin) if twin is not None else "")}
            if CHECK_DIST:
                rec["dist"] = check_dist()
            if metric is not None:
                metric.reset()
                metric.update(torch.tensor(float(rank + 1)))
                rec["metric"] = float(metric.compute())
            events.write(json.dumps(rec) + "\n")
            events.flush()
            state.step += 1
            if UNTIL_SIZE:
                state.big = state.big + 1 if elastic.size() >= UNTIL_SIZE else 0
            with open(os.path.join(OUT, f"progress-{WORKER}.txt"), "w") as f:
                f.write(f"{state.step} {elastic.size()} {elastic.world_version()}")
            if STEP_SLEEP:
                time.sleep(STEP_SLEEP)
            if state.step % COMMIT_EVERY == 0:
                state.commit()
        state.commit()

    train(state)
    result = {"digest": digest(net) + (digest(twin) if twin is not None else ""), "version": elastic.world_version(), "size": elastic.size(),
              "rank": elastic.rank(), "dist_initialized": dist.is_initialized(),
              "params": {n: t.detach().double().reshape(-1).tolist()
                         for n, t in list(net.named_parameters()) + list(net.named_buffers())}}
    with open(os.path.join(OUT, f"result-{WORKER}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
