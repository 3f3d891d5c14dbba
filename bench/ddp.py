"""DDP steps/s: torch DDP over gloo (torchrun) against elastic.DistributedDataParallel (elastic-run).

    python bench/ddp.py                        # 2 and 4 ranks, 2 repeats of every launch
    python bench/ddp.py --ranks 2 --steps 10 --rounds 2 --repeats 1

Every configuration is a real launch of bench/_ddp_worker.py on this host, with the same
~9M-parameter MLP, the same batch of 32 per rank, SGD with momentum, DDP's default 25 MB
buckets and one torch thread per rank:

  gloo   torchrun --standalone --nproc-per-node N bench/_ddp_worker.py --mode gloo
         torch.nn.parallel.DistributedDataParallel on a gloo group (TCP on loopback).
  shm    elastic-run --np N -- python bench/_ddp_worker.py --mode elastic
         elastic.DistributedDataParallel on the ring; ranks on one host exchange data through
         shared memory (the default, ELASTIC_TRANSPORT=auto).
  tcp    the same with ELASTIC_TRANSPORT=tcp: every ring link on TCP, like gloo's.

The peer runs as torch documents DDP (docs.pytorch.org, DistributedDataParallel and the DDP
notes): its defaults (25 MB buckets, buffers broadcast every forward) on a gloo group, the
backend torch gives for CPU; torchrun --standalone with its defaults starts it. Ours is the same
torch class with the same defaults (elastic.DistributedDataParallel subclasses it), so only the
allreduce under DDP differs. No fault is injected: torchrun's restart settings play no part.

The launches are interleaved (gloo, shm, tcp for each size, --repeats times) so that load
from elsewhere on the machine falls on all of them alike. Each worker runs --warmup untimed
steps, then --rounds rounds of --steps steps between barriers; the table shows the median
steps/s over every round of every repeat, and the slowest and fastest round. The ratio is
ours/gloo, against the targets (>= 1.0x over TCP, >= 1.3x with shared memory).
Launcher start-up (process spawn,
rendezvous, ring or gloo set-up) is not timed. Nothing is asserted: on a machine shared with
other work the numbers are noisy; the load average at start and end is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import Launch, new_tag  # noqa: E402  (bench/ is this script's directory)

WORKER = os.path.join(REPO, "bench", "_ddp_worker.py")
BIN = os.path.dirname(sys.executable)   # torchrun and elastic-run of this environment
CONFIGS = ("gloo", "shm", "tcp")
TARGETS = {"shm": 1.3, "tcp": 1.0}
def command(config: str, n: int, args) -> list:
    timing = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    if config == "gloo":
        return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", str(n), WORKER,
                "--mode", "gloo", *timing]
    return [os.path.join(BIN, "elastic-run"), "--np", str(n), "--max-restarts", "0", "--",
            sys.executable, WORKER, "--mode", "elastic", *timing]


def launch(config: str, n: int, args, out: str) -> dict:
    """One run of the worker under its launcher; rank 0's result line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ELASTIC_TRANSPORT", None)
    if config == "tcp":
        env["ELASTIC_TRANSPORT"] = "tcp"
    log = os.path.join(out, f"{config}-{n}-{time.monotonic_ns()}.log")
    run = Launch(command(config, n, args), env, new_tag("bench-ddp"), log, cwd=REPO)
    try:
        code = run.wait(args.timeout)
        text = run.output()
        if code is None:
            raise RuntimeError(f"{config} with {n} ranks did not finish within {args.timeout:g} s; log {log}")
        results = [json.loads(line.split("BENCH_RESULT ", 1)[1]) for line in text.splitlines()
                   if "BENCH_RESULT " in line]
        if code != 0 or len(results) != 1:
            tail = "\n".join(text.splitlines()[-15:])
            raise RuntimeError(f"{config} with {n} ranks: exit status {code}, {len(results)} result line(s); "
                               f"log {log}:\n{tail}")
        result = results[0]
        if result["size"] != n:
            raise RuntimeError(f"{config}: asked for {n} ranks, the worker ran in a world of {result['size']}")
        want = {"shm": "shm", "tcp": "tcp"}.get(config)
        if want and set(result["links"]) != {want}:
            raise RuntimeError(f"{config}: rank 0's ring links are {result['links']}, expected {want}")
        return result
    finally:
        run.close()


def load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per launch (default 5)")
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per launch (default 3)")
    ap.add_argument("--repeats", type=int, default=2, help="launches of every configuration, interleaved (default 2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one launch may take (default 600)")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the launchers' logs (their directory is printed; kept anyway when a launch fails)")
    args = ap.parse_args(argv)
    if min(args.ranks) < 2 or min(args.steps, args.rounds, args.repeats) < 1 or args.warmup < 0:
        ap.error("need --ranks >= 2, --steps/--rounds/--repeats >= 1, --warmup >= 0")

    # SIGTERM unwinds like Ctrl-C: the running launch's finally takes its processes down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = tempfile.mkdtemp(prefix="bench-ddp-")
    rates = {(c, n): [] for n in args.ranks for c in CONFIGS}
    params = None
    done = False
    print(f"# {os.cpu_count()} CPUs, load average {load()} at start; 1 torch thread per rank; batch 32 per rank; "
          f"{args.warmup} warm-up steps, then {args.repeats} x {args.rounds} rounds of {args.steps} steps; "
          f"logs in {out}", flush=True)
    try:
        for rep in range(args.repeats):
            for n in args.ranks:
                for c in CONFIGS:
                    r = launch(c, n, args, out)
                    params = r["params"]
                    rates[(c, n)] += r["steps_per_s"]
                    print(f"#   repeat {rep + 1}: {c:>4} x {n}: " + " ".join(f"{s:.2f}" for s in r["steps_per_s"])
                          + " steps/s", flush=True)
        done = True
    except KeyboardInterrupt:
        print("# interrupted: every process of the launch was stopped", flush=True)
        return 130
    finally:
        if done and not args.keep_logs:   # a failed launch's log is named in the error: keep it
            for f in os.listdir(out):
                os.unlink(os.path.join(out, f))
            os.rmdir(out)
    print(f"# load average {load()} at end; MLP of {params / 1e6:.1f}M parameters "
          f"({params * 4 / 2**20:.0f} MiB of gradients per step)")
    print()
    print("| ranks | ours over | gloo-DDP steps/s | elastic DDP steps/s | ours/gloo | target |")
    print("| --- | --- | --- | --- | --- | --- |")

    def cell(xs):
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    for n in args.ranks:
        gloo = rates[("gloo", n)]
        for c, name in (("tcp", "TCP"), ("shm", "shared memory")):
            ours = rates[(c, n)]
            ratio = statistics.median(ours) / statistics.median(gloo)
            target = TARGETS[c]
            print(f"| {n} | {name} | {cell(gloo)} | {cell(ours)} | {ratio:.2f}x | >= {target:.1f}x "
                  f"({'met' if ratio >= target else 'missed'}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
