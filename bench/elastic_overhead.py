"""Training-loop overhead: our DistributedOptimizer, with and without commits, against torch DDP (gloo).

    python bench/elastic_overhead.py                 # 2 and 4 ranks
    python bench/elastic_overhead.py --ranks 2 --steps 20

Each rank is a process on this machine running a ~10M-parameter MLP on synthetic data. In the
same processes, alternating, it times: (a) elastic DistributedOptimizer, (b) the same with
state.commit() every 10 steps (an in-memory copy of model + optimizer + a membership check),
(c) DistributedDataParallel over gloo. It also times check_membership() alone. A real
rendezvous server (in-memory store) is started for the run. BENCH_TRACE=1 prints every
commit's duration on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10))


def worker(steps: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import elastic

    torch.set_num_threads(1)
    elastic.init()
    rank, size = elastic.rank(), elastic.size()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_GLOO_PORT']}", rank=rank,
                            world_size=size)
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(rank))
    loss_fn = torch.nn.CrossEntropyLoss()

    ours_model = build_model(torch)
    ours_opt = elastic.DistributedOptimizer(torch.optim.SGD(ours_model.parameters(), lr=0.01, momentum=0.9),
                                            named_parameters=ours_model.named_parameters())
    state = elastic.TorchState(model=ours_model, optimizer=ours_opt, step=0)
    ddp_model = torch.nn.parallel.DistributedDataParallel(build_model(torch))
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)
    params = sum(p.numel() for p in ours_model.parameters())

    def ours(commit: bool):
        for i in range(steps):
            ours_opt.zero_grad()
            loss_fn(ours_model(x), y).backward()
            ours_opt.step()
            state.step += 1
            if commit and i % 10 == 9:
                t0 = time.perf_counter()
                state.commit()
                if os.environ.get("BENCH_TRACE"):
                    print(f"rank {rank} commit {(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)

    def ddp():
        for _ in range(steps):
            ddp_opt.zero_grad()
            loss_fn(ddp_model(x), y).backward()
            ddp_opt.step()

    runs = {"ours": lambda: ours(False), "ours+commit": lambda: ours(True), "ddp-gloo": ddp}
    for fn in runs.values():  # warm-up
        fn()
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            elastic.barrier()
            t0 = time.perf_counter()
            fn()
            elastic.barrier()
            times[name].append(steps / (time.perf_counter() - t0))
    checks = []
    for _ in range(5):
        elastic.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            state.check_membership()
        checks.append((time.perf_counter() - t0) / 200)
    if rank == 0:
        print("RESULT " + json.dumps({"size": size, "params": params,
                                      "steps_per_s": {k: statistics.median(v) for k, v in times.items()},
                                      "check_membership_us": statistics.median(checks) * 1e6}), flush=True)
    dist.destroy_process_group()
    elastic.shutdown(True)


def run(n: int, steps: int, rounds: int, server: str) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ELASTIC_RENDEZVOUS=server, ELASTIC_JOB_ID=f"bench-{n}-{os.getpid()}", ELASTIC_MIN_NP=str(n),
               ELASTIC_MAX_NP=str(n), BENCH_GLOO_PORT=str(free_port()), ELASTIC_COLLECTIVE_TIMEOUT="120")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(steps), "--rounds", str(rounds)],
                              env=dict(env, ELASTIC_WORKER_ID=f"w{r}"), stdout=subprocess.PIPE, text=True)
             for r in range(n)]
    result = None
    try:
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    result = json.loads(line[7:])
            if p.returncode != 0:
                raise RuntimeError(f"a benchmark worker exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if result is None:
        raise RuntimeError("rank 0 printed no result")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per measurement (default 30)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is shown (default 3)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.steps, args.rounds)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        server = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--insecure", "--host", "127.0.0.1",
                                   "--port", "0", "--port-file", port_file, "--log-level", "WARNING"], cwd=REPO,
                                  env=dict(os.environ, PYTHONPATH=REPO))
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(port_file):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("rendezvous server did not start")
                time.sleep(0.05)
            address = "127.0.0.1:" + open(port_file).read().strip()
            print(f"# ~10M-parameter MLP, batch 32 per rank, {os.cpu_count()} CPUs, 1 torch thread per rank; "
                  f"steps/s (median of {args.rounds})")
            print(f"{'ranks':>5} {'params':>9} | {'ours':>8} {'+commit/10':>10} {'commit cost':>11} | "
                  f"{'ddp-gloo':>8} {'ours/ddp':>8} | {'check_membership':>16}")
            for n in args.ranks:
                r = run(n, args.steps, args.rounds, address)
                s = r["steps_per_s"]
                cost = 1 - s["ours+commit"] / s["ours"]
                print(f"{n:>5} {r['params'] / 1e6:>8.1f}M | {s['ours']:>8.2f} {s['ours+commit']:>10.2f} "
                      f"{cost * 100:>10.1f}% | {s['ddp-gloo']:>8.2f} {s['ours'] / s['ddp-gloo']:>7.2f}x | "
                      f"{r['check_membership_us']:>13.0f} us", flush=True)
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
