"""One worker of bench/fsdp_recovery.py: an FSDP2 model under elastic.ShardedState, logging steps,
commits (their duration and bytes) and every world (the bytes its reshard moved, the ring's
allgather bandwidth measured in it).

    elastic-run --np 4 --min-np 2 --max-restarts 0 -- python bench/_fsdp_recovery_worker.py --run-dir DIR

Appends JSON lines to DIR/events-PID.jsonl and writes its pid to DIR/pids/PID.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import numpy as np
import torch
from torch.distributed.fsdp import fully_shard

import elastic
from elastic.runtime import logs, world


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(width) for _ in range(depth)], torch.nn.Linear(width, 10))


def shard(model, mesh) -> None:
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def ring_bandwidth(nbytes: int = 32 << 20, rounds: int = 3) -> float:
    """Bytes per second that one ring allgather of ``nbytes`` in all delivers to each rank."""
    comm = world.ring()
    counts = [nbytes // comm.size] * comm.size
    out = np.empty(sum(counts), dtype=np.uint8)
    mine = np.ones(counts[comm.rank], dtype=np.uint8)
    comm.allgather_into_(out, mine, counts=counts)   # warm-up
    started = time.perf_counter()
    for _ in range(rounds):
        comm.allgather_into_(out, mine, counts=counts)
    return rounds * sum(counts) / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--meta-build", action="store_true", help="build() on the meta device once a commit is held")
    args = p.parse_args()
    torch.set_num_threads(1)
    pid = os.getpid()
    os.makedirs(os.path.join(args.run_dir, "pids"), exist_ok=True)
    with open(os.path.join(args.run_dir, "pids", str(pid)), "w") as f:
        f.write(str(pid))
    out = open(os.path.join(args.run_dir, f"events-{pid}.jsonl"), "a", buffering=1)

    def log(ev: str, **fields) -> None:
        out.write(json.dumps({"ev": ev, "t": time.time(), "pid": pid, **fields}) + "\n")

    class Events(logging.Handler):
        """elastic's own log lines, timed: when a failure surfaced, when the next ring formed."""

        def emit(self, record: logging.LogRecord) -> None:
            out.write(json.dumps({"ev": "log", "t": record.created, "pid": pid, "msg": record.getMessage()}) + "\n")

    elastic_log = logging.getLogger("elastic")   # configured here, so elastic leaves it as it is
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter(logs.FORMAT))
    elastic_log.addHandler(stderr)
    elastic_log.addHandler(Events())
    elastic_log.setLevel(logging.INFO)

    def build() -> torch.nn.Module:
        # Once this worker holds a commit every value comes from it: the meta device skips the
        # random initialisation that would be overwritten (docs: "From torchrun: FSDP2").
        if args.meta_build and state.commit_step >= 0:
            with torch.device("meta"):
                return build_model(args.width, args.depth)
        return build_model(args.width, args.depth)

    state = elastic.ShardedState(build, shard,
                                 optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4), step=0)

    @elastic.run
    def train(state):
        v, rank, size = elastic.world_version(), elastic.rank(), elastic.size()
        r = state.last_reshard or {}
        log("world", v=v, rank=rank, size=size, step=state.step, moved=r.get("moved_bytes", 0),
            buddy=r.get("buddy_bytes", 0), own=state.memory_bytes()["own"], reshard_s=r.get("seconds", 0.0),
            phases=r.get("phases", {}))
        measured = False
        model, opt = state.model, state.optimizer
        loss_fn = torch.nn.CrossEntropyLoss()
        while True:
            g = torch.Generator().manual_seed(1000 * state.step + rank)
            x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
            started = time.perf_counter()
            loss = loss_fn(model(x), y)
            t_fwd = time.perf_counter()
            loss.backward()
            t_bwd = time.perf_counter()
            opt.step()
            opt.zero_grad()
            state.step += 1
            done = time.perf_counter()
            log("step", v=v, size=size, step=state.step, seconds=done - started,
                parts=[t_fwd - started, t_bwd - t_fwd, done - t_bwd])
            if not measured:   # after the world's first step, which the recovery time includes
                log("bandwidth", v=v, size=size, bandwidth=ring_bandwidth())
                measured = True
            if state.step % args.commit_every == 0:
                started = time.perf_counter()
                state.commit()
                log("commit", v=v, size=size, step=state.step, seconds=time.perf_counter() - started,
                    memory=state.memory_bytes())

    train(state)


if __name__ == "__main__":
    main()
