"""One worker of bench/stragglers.py: a DDP job under elastic-run whose steps are mostly compute.

    elastic-run --np 4 -- python bench/_straggler_worker.py --run-dir DIR --commit-every 10

An MLP of ~1.1M parameters (1024-512-512-512-10) on --batch samples per rank and step (default
256), SGD with momentum, elastic.DistributedDataParallel with its default buckets inside
@elastic.run, state.commit() every --commit-every steps, one torch thread. The gradients (~4 MB)
are small next to the step's arithmetic, as in most real jobs: a straggler shows in how long a
rank computes. Steps are numbered globally from 1 and trained until the process is killed.

Slowed (bench/stragglers.py --slowdown throttle): once the file BENCH_SLOW_FILE exists and names
this worker's ELASTIC_WORKER_ID, after each forward pass it idles twice as long as that pass took
(roughly as long as its forward and backward computed), as a worker under a 50% CPU quota would:
its compute time between collectives doubles whatever else shares the CPU.

It logs as bench/_goodput_worker.py does (DIR/pids/PID, and JSON lines {"ev": "step"|"commit",
"step", "t", "gen" (the world version), "size", "pid"} in DIR/events-PID.jsonl), so the
driver reads both alike; BENCH_DEADLINE ends it at that time whatever happens.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from _goodput_worker import Events, watchdog  # bench/ is this script's directory


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="directory for the pid files and event logs")
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits (default 10)")
    p.add_argument("--batch", type=int, default=256, help="samples per rank and step (default 256)")
    args = p.parse_args()
    if args.commit_every < 1 or args.batch < 1:
        p.error("--commit-every and --batch must be at least 1")
    torch.set_num_threads(1)
    watchdog()
    events = Events(args.run_dir)

    import elastic

    net = build_model()
    model = elastic.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = elastic.TorchState(model=net, optimizer=opt, step=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    slow_file, me = os.environ.get("BENCH_SLOW_FILE"), os.environ.get("ELASTIC_WORKER_ID", "")

    def throttled() -> bool:
        try:
            with open(slow_file) as f:
                return f.read().strip() == me
        except (OSError, TypeError):
            return False

    @elastic.run
    def train(state):
        gen, rank, size = elastic.world_version(), dist.get_rank(), dist.get_world_size()
        while True:
            g = torch.Generator().manual_seed((state.step + 1) * 1000 + rank)
            x, y = torch.randn(args.batch, 1024, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
            opt.zero_grad()
            started = time.perf_counter()
            loss = loss_fn(model(x), y)
            if throttled():
                time.sleep(2 * (time.perf_counter() - started))
            loss.backward()
            opt.step()
            state.step += 1
            events.log("step", state.step, gen, size)
            if state.step % args.commit_every == 0:
                state.commit()
                events.log("commit", state.step, gen, size)

    train(state)


if __name__ == "__main__":
    main()
