"""Training-loop overhead: our DistributedOptimizer, with and without commits, against torch DDP (gloo).

    python bench/elastic_overhead.py                 # 2 and 4 ranks
    python bench/elastic_overhead.py --ranks 2 --steps 20
    python bench/elastic_overhead.py --ranks 2 --rounds 9 --steps 40   # metrics on/off, paired per round

Each rank is a process on this machine running a ~10M-parameter MLP on synthetic data. In the
same processes, alternating, it times: (a) elastic DistributedOptimizer, (b) the same with
state.commit() every 10 steps (an in-memory copy of model + optimizer + a membership check),
(c) (b) with worker metrics on (elastic.runtime.worker_metrics recording every allreduce, commit and sync, and
pushing a snapshot a second to a receiver in this process, as elastic-run --metrics-port does),
(d) DistributedDataParallel over gloo (torch's defaults, as in bench/ddp.py). (b) and (c) run back to back, in alternating order, and
their ratio is also given per round; the recording hooks of one allreduce are timed alone too
(on a loaded machine the end-to-end ratio is noise well beyond 1%; the hook cost is not). It
also times check_membership() alone. A real
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
    from elastic.runtime import lifecycle

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

    def metrics_on(name: str, on: bool) -> None:
        # Recording on for the "+metrics" measurement only, in the same processes as the one
        # without; started and stopped outside the timed part.
        if name != "+metrics":
            return
        if on:
            lifecycle.running().start_metrics(os.environ["BENCH_METRICS_SOCKET"], os.environ["BENCH_METRICS_TOKEN"])
        else:
            lifecycle.running().stop_metrics()

    runs = {"ours": lambda: ours(False), "ours+commit": lambda: ours(True), "+metrics": lambda: ours(True),
            "ddp-gloo": ddp}
    for name, fn in runs.items():  # warm-up
        metrics_on(name, True)
        fn()
        metrics_on(name, False)
    # What recording adds to one allreduce, alone: the hooks of an async allreduce and its wait
    # on this ring (what DistributedOptimizer runs per gradient), recording on.
    grad = next(ours_model.parameters()).detach()
    comm = lifecycle.running().ring()
    metrics_on("+metrics", True)
    recorder = comm.observer
    t0 = time.perf_counter()
    for _ in range(20000):
        recorder.allreduce_started(comm, grad)
        recorder.allreduce_waited(comm, grad, t0)
    hook_us = (time.perf_counter() - t0) / 20000 * 1e6
    metrics_on("+metrics", False)
    ops_per_step = len(list(ours_model.parameters())) + 0.1   # a gradient each, a membership check per 10
    times = {k: [] for k in runs}
    for i in range(rounds):
        # The pair compared for the metrics cost runs back to back, in alternating order, so a
        # neighbour's load on this shared machine hits both alike.
        pair = ["ours+commit", "+metrics"] if i % 2 == 0 else ["+metrics", "ours+commit"]
        for name in ["ours", *pair, "ddp-gloo"]:
            fn = runs[name]
            metrics_on(name, True)
            elastic.barrier()
            t0 = time.perf_counter()
            fn()
            elastic.barrier()
            times[name].append(steps / (time.perf_counter() - t0))
            metrics_on(name, False)
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
                                      "metrics_ratios": [m / c for m, c in
                                                         zip(times["+metrics"], times["ours+commit"])],
                                      "hook_us": hook_us, "ops_per_step": ops_per_step,
                                      "check_membership_us": statistics.median(checks) * 1e6}), flush=True)
    dist.destroy_process_group()
    elastic.shutdown(True)


def run(n: int, steps: int, rounds: int, server: str) -> dict:
    from elastic.launch.host_metrics import WorkerMetrics

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ELASTIC_RENDEZVOUS=server, ELASTIC_JOB_ID=f"bench-{n}-{os.getpid()}", ELASTIC_MIN_NP=str(n),
               ELASTIC_MAX_NP=str(n), BENCH_GLOO_PORT=str(free_port()), ELASTIC_COLLECTIVE_TIMEOUT="120")
    sink = WorkerMetrics("127.0.0.1", 0)   # the launcher's receiver and /metrics, in this process
    procs = []
    for r in range(n):
        pushed = sink.worker_env(f"w{r}")
        # Not the ELASTIC_METRICS_* names: those would turn recording on for every measurement.
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(steps), "--rounds",
                                       str(rounds)], stdout=subprocess.PIPE, text=True, start_new_session=True,
                                      env=dict(env, ELASTIC_WORKER_ID=f"w{r}",
                                               BENCH_METRICS_SOCKET=pushed["ELASTIC_METRICS_SOCKET"],
                                               BENCH_METRICS_TOKEN=pushed["ELASTIC_METRICS_TOKEN"])))
        sink.attach(f"w{r}", procs[-1].pid)
    result = None
    try:
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    result = json.loads(line[7:])
            if p.returncode != 0:
                raise RuntimeError(f"a benchmark worker exited with {p.returncode}")
        snaps = sink.snapshots()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sink.close()
    if result is None:
        raise RuntimeError("rank 0 printed no result")
    # The snapshots that arrived while metrics were on: proof the measured path really recorded.
    result["metrics_steps"] = sum(s.steps for s, _ in snaps.values())
    result["metrics_dropped"] = sum(sink.dropped.values())
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
                  f"{'+metrics':>8} {'metrics/off':>11} | {'ddp-gloo':>8} {'ours/ddp':>8} | {'check_membership':>16}")
            for n in args.ranks:
                r = run(n, args.steps, args.rounds, address)
                s = r["steps_per_s"]
                cost = 1 - s["ours+commit"] / s["ours"]
                print(f"{n:>5} {r['params'] / 1e6:>8.1f}M | {s['ours']:>8.2f} {s['ours+commit']:>10.2f} "
                      f"{cost * 100:>10.1f}% | {s['+metrics']:>8.2f} {s['+metrics'] / s['ours+commit']:>10.3f}x | "
                      f"{s['ddp-gloo']:>8.2f} {s['ours'] / s['ddp-gloo']:>7.2f}x | "
                      f"{r['check_membership_us']:>13.0f} us", flush=True)
                ratios = sorted(r["metrics_ratios"])
                hook_share = r["hook_us"] * r["ops_per_step"] * s["+metrics"] / 1e6
                print(f"#   metrics on / off, paired per round: median {statistics.median(ratios):.3f}x "
                      f"(range {ratios[0]:.3f}-{ratios[-1]:.3f} over {len(ratios)} rounds); recording costs "
                      f"{r['hook_us']:.2f} us per allreduce, {r['ops_per_step']:.1f} per step: "
                      f"{hook_share * 100:.3f}% of a step", flush=True)
                print(f"#   metrics on: {r['metrics_steps']} commits recorded in the last snapshots, "
                      f"{r['metrics_dropped']} dropped", flush=True)
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
