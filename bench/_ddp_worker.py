"""One rank of bench/ddp.py: the same DDP training step under torchrun (gloo) or elastic-run (the ring).

    torchrun --standalone --nproc-per-node 2 bench/_ddp_worker.py --mode gloo
    elastic-run --np 2 -- python bench/_ddp_worker.py --mode elastic

Both modes build the same ~9M-parameter MLP from the same seed, feed it the same per-rank
batch and step an SGD optimizer through ``torch.nn.parallel.DistributedDataParallel`` with
its default buckets: ``--mode gloo`` on the gloo group torchrun's environment describes,
``--mode elastic`` as ``elastic.DistributedDataParallel`` inside ``elastic.run`` (the comm
hook on the ring; ELASTIC_TRANSPORT picks shared memory or TCP). After ``--warmup`` steps it
times ``--rounds`` rounds of ``--steps`` steps, each between two barriers, and rank 0 prints
one line ``BENCH_RESULT {json}`` (steps/s of every round, the ring's link kinds).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import elastic_overhead  # this script's folder is first on sys.path: bench/

BATCH = 32


def build_model() -> torch.nn.Module:
    """The MLP of bench/elastic_overhead.py: ~9M parameters, large enough that the gradient
    allreduce (~36 MB a step) is a real part of the step on a CPU."""
    return elastic_overhead.build_model(torch)


def batch(rank: int):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, 1024, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def timed(model, opt, rank: int, warmup: int, steps: int, rounds: int) -> list:
    """Steps/s of each round; every rank runs the same steps, the barriers line the rounds up."""
    x, y = batch(rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    rates = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        rates.append(steps / (time.perf_counter() - t0))
    return rates


def report(mode: str, rates: list, params: int, links) -> None:
    if dist.get_rank() == 0:
        print("BENCH_RESULT " + json.dumps({"mode": mode, "size": dist.get_world_size(), "params": params,
                                            "steps_per_s": rates, "links": links}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("gloo", "elastic"), required=True,
                   help="gloo: torch DDP on gloo (start with torchrun); elastic: elastic.DistributedDataParallel "
                        "(start with elastic-run)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed round (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be at least 1, --warmup at least 0")
    torch.set_num_threads(1)
    net = build_model()
    params = sum(q.numel() for q in net.parameters())

    if args.mode == "gloo":
        dist.init_process_group("gloo")   # torchrun's env://: MASTER_ADDR, RANK, WORLD_SIZE …
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        rates = timed(model, opt, dist.get_rank(), args.warmup, args.steps, args.rounds)
        report("gloo", rates, params, None)
        dist.destroy_process_group()
        return

    import elastic

    model = elastic.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = elastic.TorchState(model=net, optimizer=opt)

    @elastic.run
    def train(state):
        rates = timed(model, opt, dist.get_rank(), args.warmup, args.steps, args.rounds)
        report("elastic", rates, params, list(elastic.runtime.world.ring().link_kinds))

    train(state)


if __name__ == "__main__":
    main()
