"""One worker of bench/goodput.py: the same DDP training loop under torchrun or elastic-run, logging every step.

    torchrun --standalone --nproc-per-node 4 --max-restarts 9 bench/_goodput_worker.py --launcher torchrun \
        --run-dir DIR --checkpoint DIR/ckpt.pt
    elastic-run --np 4 --min-np 2 -- python bench/_goodput_worker.py --launcher elastic --run-dir DIR

The model, batch and optimizer are bench/_ddp_worker.py's (~9M-parameter MLP, 32 samples per
rank and step, SGD with momentum, DDP's default buckets, one torch thread). Steps are numbered
globally from 1 and trained until the process is killed (the driver ends every run; the
BENCH_DEADLINE watchdog ends a worker it lost track of).

  torchrun   as torchrun's documentation advises for fault tolerance: rank 0 saves model,
             optimizer and step to --checkpoint every --commit-every steps (a temporary file,
             then a rename, so a kill mid-write leaves the previous one); every start loads it
             when it exists. Any failure makes torchrun restart every worker.
  elastic    elastic.DistributedDataParallel inside @elastic.run with state.commit() every
             --commit-every steps; a failure costs the survivors a restore of the last commit.

With --fsdp the model is sharded with FSDP2 (each Linear, then the root) and trained with AdamW:

  torchrun   FSDP2 over gloo; every --commit-every steps all ranks save model, optimizer,
             step and stream position with torch.distributed.checkpoint (dcp.save, into a
             new directory; rank 0 then points DIR/latest at it); every start reloads the
             latest with dcp.load.
  elastic    elastic.ShardedState (shards committed in memory and on the buddy every
             --commit-every steps); a failure costs the survivors a reshard of the last commit.

Data: one stream of samples numbered from 0. A step of a world of N ranks trains the next
N x 32 of them, rank r the r-th 32; the stream position (samples consumed) is part of the
checkpoint (torchrun) or of the committed state (elastic), so a restore replays exactly the
samples of the steps it undid and a smaller world skips none. A batch is a function of its
sample indices (batch_for), whichever rank or system trains it.

Every worker writes its pid to DIR/pids/PID and appends JSON lines to DIR/events-PID.jsonl:
{"ev": "step"|"commit"|"resume", "step", "t" (time.time()), "gen" (elastic: the world version;
torchrun: TORCHELASTIC_RESTART_COUNT), "size", "pid"}, and on "step" "samples": [start, stop,
stride], the indices its world trained in it (range(start, stop, stride)): every rank's, since a
rank that completed a step holds an update averaged over all ranks' gradients (after a failure
only some ranks may have completed it, and the sync carries their state to all). "commit" is logged
once the commit is held: after state.commit() returned, after the checkpoint's rename. "resume"
is logged where a (new) world's training loop starts, its state loaded or synced, with the step
it trains next: recovery splits into the time to resume and the first step after it.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from _ddp_worker import BATCH, build_model  # bench/ is this script's directory


class Events:
    """This process's event log; a line reaches the kernel at once, so a SIGKILL loses none."""

    def __init__(self, run_dir: str):
        self.pid = os.getpid()
        os.makedirs(os.path.join(run_dir, "pids"), exist_ok=True)
        with open(os.path.join(run_dir, "pids", str(self.pid)), "w") as f:
            f.write(str(self.pid))
        self._f = open(os.path.join(run_dir, f"events-{self.pid}.jsonl"), "a", buffering=1)

    def log(self, ev: str, step: int, gen: int, size: int, samples: Optional[Tuple[int, int, int]] = None) -> None:
        line = {"ev": ev, "step": step, "t": time.time(), "gen": gen, "size": size, "pid": self.pid}
        if samples is not None:
            line["samples"] = list(samples)
        self._f.write(json.dumps(line) + "\n")


def watchdog() -> None:
    """Exit at BENCH_DEADLINE (seconds since the epoch) whatever happens: no orphan trains on."""
    deadline = float(os.environ.get("BENCH_DEADLINE", "0") or 0)
    if deadline <= 0:
        return

    def run():
        while time.time() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.time())))
        os._exit(3)

    threading.Thread(target=run, name="bench-deadline", daemon=True).start()


def batch_for(samples: Tuple[int, int, int]):
    """The batch of these sample indices: the same inputs wherever and whenever they are trained."""
    start, stop, stride = samples
    g = torch.Generator().manual_seed((start * 1_000_003 + stride) % (1 << 62))
    return torch.randn(BATCH, 1024, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def train_forever(state, step, events, commit_every: int, gen: int, rank: int, size: int) -> None:
    """elastic-run's loop: the world's next samples, one step, a log line, a commit every
    ``commit_every`` steps (the cursor is committed state, so a restore replays the same samples)."""
    while True:
        start = state.cursor
        step(rank_samples(start, rank))
        state.step += 1
        state.cursor += size * BATCH
        events.log("step", state.step, gen, size, world_samples(start, size))
        if state.step % commit_every == 0:
            state.commit()
            events.log("commit", state.step, gen, size)


def world_samples(cursor: int, size: int) -> Tuple[int, int, int]:
    """Every index a world of ``size`` trains in the step that starts at stream position ``cursor``."""
    return (cursor, cursor + size * BATCH, 1)


def rank_samples(cursor: int, rank: int) -> Tuple[int, int, int]:
    """This rank's indices in the step that starts at stream position ``cursor``."""
    return (cursor + rank * BATCH, cursor + (rank + 1) * BATCH, 1)


def make_step(model, opt):
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(samples: Tuple[int, int, int]) -> None:
        x, y = batch_for(samples)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def torchrun_worker(args, events: Events) -> None:
    dist.init_process_group("gloo")
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, size = dist.get_rank(), dist.get_world_size()
    net = build_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    done = cursor = 0
    if os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, weights_only=True)   # tensors and numbers only: nothing unpickled
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        done, cursor = int(ckpt["step"]), int(ckpt["cursor"])
    model = torch.nn.parallel.DistributedDataParallel(net)   # broadcasts rank 0's parameters
    step = make_step(model, opt)
    events.log("resume", done + 1, gen, size)
    while True:
        done += 1
        samples = rank_samples(cursor, rank)
        step(samples)
        events.log("step", done, gen, size, world_samples(cursor, size))
        cursor += size * BATCH
        if done % args.commit_every == 0 and rank == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": done, "cursor": cursor},
                       tmp)
            os.replace(tmp, args.checkpoint)
            events.log("commit", done, gen, size)


def elastic_worker(args, events: Events) -> None:
    import elastic

    net = build_model()
    model = elastic.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = elastic.TorchState(model=net, optimizer=opt, step=0, cursor=0)
    step = make_step(model, opt)

    @elastic.run
    def train(state):
        gen, rank, size = elastic.world_version(), dist.get_rank(), dist.get_world_size()
        events.log("resume", state.step + 1, gen, size)
        train_forever(state, step, events, args.commit_every, gen, rank, size)

    train(state)


def shard(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def torchrun_fsdp_worker(args, events: Events) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = build_model()
    shard(net, init_device_mesh("cpu", (size,)))
    opt = adamw(net.parameters())
    done = cursor = 0
    latest = os.path.join(args.checkpoint, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            where = os.path.join(args.checkpoint, f.read().strip())
        msd, osd = get_state_dict(net, opt)
        sd = {"model": msd, "optim": osd, "step": torch.zeros(1, dtype=torch.int64),
              "cursor": torch.zeros(1, dtype=torch.int64)}
        dcp.load(sd, checkpoint_id=where)
        set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        done, cursor = int(sd["step"][0]), int(sd["cursor"][0])
    step = make_step(net, opt)
    while True:
        done += 1
        samples = rank_samples(cursor, rank)
        step(samples)
        events.log("step", done, gen, size, world_samples(cursor, size))
        cursor += size * BATCH
        if done % args.commit_every == 0:
            msd, osd = get_state_dict(net, opt)
            name = f"step-{done}"
            dcp.save({"model": msd, "optim": osd, "step": torch.tensor([done]), "cursor": torch.tensor([cursor])},
                     checkpoint_id=os.path.join(args.checkpoint, name))
            if rank == 0:
                tmp = latest + ".tmp"
                with open(tmp, "w") as f:
                    f.write(name)
                os.replace(tmp, latest)
                events.log("commit", done, gen, size)


def elastic_fsdp_worker(args, events: Events) -> None:
    import elastic

    def build():
        torch.manual_seed(0)
        return build_model()

    state = elastic.ShardedState(build, shard, optimizer=adamw, step=0, cursor=0)

    @elastic.run
    def train(state):
        gen, rank, size = elastic.world_version(), elastic.rank(), elastic.size()
        step = make_step(state.model, state.optimizer)   # this world's model and optimizer
        train_forever(state, step, events, args.commit_every, gen, rank, size)

    train(state)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", choices=("torchrun", "elastic"), required=True,
                   help="which launcher runs this worker: torchrun (gloo DDP, checkpoints) or elastic (elastic-run)")
    p.add_argument("--run-dir", required=True, help="directory for the pid files and event logs")
    p.add_argument("--commit-every", type=int, default=10,
                   help="steps between checkpoints (torchrun) or commits (elastic) (default 10)")
    p.add_argument("--checkpoint", default="", help="torchrun: the checkpoint file (saved by rank 0, loaded at start); "
                   "with --fsdp a directory of DCP checkpoints")
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 and train it with AdamW")
    args = p.parse_args()
    if args.commit_every < 1:
        p.error("--commit-every must be at least 1")
    if args.launcher == "torchrun" and not args.checkpoint:
        p.error("--launcher torchrun needs --checkpoint")
    torch.set_num_threads(1)
    watchdog()
    events = Events(args.run_dir)
    if args.launcher == "torchrun":
        (torchrun_fsdp_worker if args.fsdp else torchrun_worker)(args, events)
    else:
        (elastic_fsdp_worker if args.fsdp else elastic_worker)(args, events)


if __name__ == "__main__":
    main()
