"""FSDP2 steps/s: fully_shard over gloo (torchrun) against fully_shard over the elastic ring (elastic-run).

    python bench/fsdp.py                        # 2 and 4 ranks, 2 repeats of every launch
    python bench/fsdp.py --ranks 2 --steps 3 --rounds 1 --repeats 1

Every configuration is a real launch of bench/_fsdp_worker.py on this host, with the same
~70M-parameter decoder-only transformer (10 blocks of width 640, vocabulary 16384), the same
2 x 32 tokens per rank, AdamW, FSDP2's defaults (every block and the root ``fully_shard``-ed,
float32, parameters resharded after forward) and one torch thread per rank:

  gloo   torchrun --standalone --nproc-per-node N bench/_fsdp_worker.py --mode gloo
         FSDP2 on a 1-D mesh over the gloo group (TCP on loopback).
  shm    elastic-run --np N -- python bench/_fsdp_worker.py --mode elastic
         FSDP2 on elastic.device_mesh(): its all-gathers and reduce-scatters are ring phases;
         ranks on one host exchange data through shared memory (ELASTIC_TRANSPORT=auto).
  tcp    the same with ELASTIC_TRANSPORT=tcp: every ring link on TCP, like gloo's.

With --paired, two more launches per size train both in the same processes (bench/_fsdp_worker.py
--mode paired under ELASTIC_DEFAULT_GROUP=0 elastic-run: a gloo group and the elastic mesh, timed
rounds alternating), over shared memory and over TCP: the fairest comparison on a machine whose
load changes between launches, at the price of two models per process.

The peer runs as torch's FSDP2 tutorial builds a model (docs.pytorch.org/tutorials,
intermediate/FSDP_tutorial: fully_shard each transformer block, then the root) on
init_device_mesh("cpu", (N,)), a gloo group, with fully_shard's defaults; ours makes the same
calls on elastic.device_mesh(). Only the collectives under FSDP2 differ.

The launches are interleaved (gloo, shm, tcp for each size, --repeats times) so that load from
elsewhere on the machine falls on all of them alike. Each worker runs --warmup untimed steps,
then --rounds rounds of --steps steps between barriers. The first table shows the median
steps/s over every round of every repeat (slowest and fastest round in brackets) and the ratio
ours/gloo against the targets (>= 1.0x over TCP, >= 1.3x with shared memory); the second where
a step's time goes: inside FSDP2's all-gathers, inside its reduce-scatters, and the rest
(compute, optimizer, copies); the third the raw collectives on one block's parameters in the
same processes (median of 5, ms). Launcher start-up is not timed. Nothing is asserted: on a
machine shared with other work the numbers are noisy; the load average at start and end is
printed with them.
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

WORKER = os.path.join(REPO, "bench", "_fsdp_worker.py")
BIN = os.path.dirname(sys.executable)   # torchrun and elastic-run of this environment
CONFIGS = ("gloo", "shm", "tcp")
PAIRED = ("paired-shm", "paired-tcp")
NAMES = {"gloo": "gloo (torchrun)", "shm": "ours, shared memory (elastic-run)", "tcp": "ours, TCP (elastic-run)",
         "paired-shm/gloo": "gloo, paired with shared memory", "paired-shm/ours": "ours, shared memory, paired",
         "paired-tcp/gloo": "gloo, paired with TCP", "paired-tcp/ours": "ours, TCP, paired"}
TARGETS = {"shm": 1.3, "tcp": 1.0}


def command(config: str, n: int, args) -> list:
    opts = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--layers", str(args.layers), "--dim", str(args.dim), "--seq", str(args.seq), "--batch", str(args.batch)]
    if config == "gloo":
        return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", str(n), WORKER,
                "--mode", "gloo", *opts]
    mode = "paired" if config.startswith("paired") else "elastic"
    return [os.path.join(BIN, "elastic-run"), "--np", str(n), "--max-restarts", "0", "--",
            sys.executable, WORKER, "--mode", mode, *opts]


def launch(config: str, n: int, args, out: str) -> dict:
    """One run of the worker under its launcher; rank 0's result line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ELASTIC_TRANSPORT", None)
    if config.endswith("tcp"):
        env["ELASTIC_TRANSPORT"] = "tcp"
    if config.startswith("paired"):
        env["ELASTIC_DEFAULT_GROUP"] = "0"   # the worker makes gloo the default group
    log = os.path.join(out, f"{config}-{n}-{time.monotonic_ns()}.log")
    run = Launch(command(config, n, args), env, new_tag("bench-fsdp"), log, cwd=REPO)
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
        want = None if config == "gloo" else config.rsplit("-", 1)[-1]
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
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per launch (default 2)")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed round (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per launch (default 2)")
    ap.add_argument("--repeats", type=int, default=2, help="launches of every configuration, interleaved (default 2)")
    ap.add_argument("--layers", type=int, default=10, help="transformer blocks (default 10)")
    ap.add_argument("--dim", type=int, default=640, help="model width, a multiple of 64 (default 640)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    ap.add_argument("--paired", action="store_true",
                    help="also train over gloo and over the ring in the same processes, rounds alternating")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one launch may take (default 900)")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the launchers' logs (their directory is printed; kept anyway when a launch fails)")
    args = ap.parse_args(argv)
    if min(args.ranks) < 2 or min(args.steps, args.rounds, args.repeats) < 1 or args.warmup < 0:
        ap.error("need --ranks >= 2, --steps/--rounds/--repeats >= 1, --warmup >= 0")
    if args.dim < 64 or args.dim % 64 or args.layers < 1:
        ap.error("need --dim a multiple of 64 (the attention heads' width) and --layers >= 1")

    # SIGTERM unwinds like Ctrl-C: the running launch's finally takes its processes down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = tempfile.mkdtemp(prefix="bench-fsdp-")
    configs = CONFIGS + (PAIRED if args.paired else ())
    # (series, ranks) -> rounds and micro-benchmarks; a series is a launch's group: "gloo" (torchrun),
    # "shm"/"tcp" (elastic-run), "paired-shm/gloo", "paired-shm/ours" … (both in one launch).
    rounds: dict = {}
    micro: dict = {}
    params = None
    done = False
    print(f"# {os.cpu_count()} CPUs, load average {load()} at start; 1 torch thread per rank; "
          f"{args.batch} x {args.seq} tokens per rank; {args.warmup} warm-up steps, then {args.repeats} x "
          f"{args.rounds} rounds of {args.steps} steps; logs in {out}", flush=True)
    try:
        for rep in range(args.repeats):
            for n in args.ranks:
                for c in configs:
                    r = launch(c, n, args, out)
                    params = r["params"]
                    for group, res in r["results"].items():
                        series = c if c in CONFIGS else f"{c}/{'ours' if group == 'elastic' else 'gloo'}"
                        rounds.setdefault((series, n), []).extend(res["rounds"])
                        micro.setdefault((series, n), []).append(res["micro"])
                        print(f"#   repeat {rep + 1}: {series:>15} x {n}: "
                              + " ".join(f"{x['steps_per_s']:.3f}" for x in res["rounds"]) + " steps/s", flush=True)
        done = True
    except KeyboardInterrupt:
        print("# interrupted: every process of the launch was stopped", flush=True)
        return 130
    finally:
        if done and not args.keep_logs:   # a failed launch's log is named in the error: keep it
            for f in os.listdir(out):
                os.unlink(os.path.join(out, f))
            os.rmdir(out)
    print(f"# load average {load()} at end; transformer of {params / 1e6:.1f}M parameters "
          f"({params * 4 / 2**20:.0f} MiB float32: gathered twice and reduce-scattered once per step)")

    def rates(series, n):
        return [x["steps_per_s"] for x in rounds[(series, n)]]

    def cell(xs):
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    def ratio_table(title: str, pairs) -> None:
        print()
        print(f"| ranks | ours over | {title} |")
        print("| --- | --- | --- | --- | --- | --- |")
        for n in args.ranks:
            for gloo_series, ours_series, transport, name in pairs:
                gloo, ours = rates(gloo_series, n), rates(ours_series, n)
                ratio = statistics.median(ours) / statistics.median(gloo)
                target = TARGETS[transport]
                print(f"| {n} | {name} | {cell(gloo)} | {cell(ours)} | {ratio:.2f}x | >= {target:.1f}x "
                      f"({'met' if ratio >= target else 'missed'}) |")

    ratio_table("gloo FSDP2 steps/s (torchrun) | elastic FSDP2 steps/s (elastic-run) | ours/gloo | target",
                [("gloo", "tcp", "tcp", "TCP"), ("gloo", "shm", "shm", "shared memory")])
    if args.paired:
        ratio_table("gloo FSDP2 steps/s (same processes) | elastic FSDP2 steps/s (same processes) | ours/gloo | "
                    "target", [("paired-tcp/gloo", "paired-tcp/ours", "tcp", "TCP"),
                               ("paired-shm/gloo", "paired-shm/ours", "shm", "shared memory")])
    series_names = sorted({s for s, _ in rounds}, key=lambda s: (s.startswith("paired"), s))
    print()
    print("| ranks | run | step s | in all-gathers s | in reduce-scatters s | rest s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.ranks:
        for series in series_names:
            med = {k: statistics.median(x[k] for x in rounds[(series, n)])
                   for k in ("step_s", "all_gather_s", "reduce_scatter_s")}
            rest = med["step_s"] - med["all_gather_s"] - med["reduce_scatter_s"]
            print(f"| {n} | {NAMES.get(series, series)} | {med['step_s']:.3f} | {med['all_gather_s']:.3f} | "
                  f"{med['reduce_scatter_s']:.3f} | {rest:.3f} |")
    print()
    print("| ranks | one block, MiB | run | all_gather_into_tensor ms | reduce_scatter_tensor ms |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.ranks:
        for series in series_names:
            ms = micro[(series, n)]
            ag = statistics.median(m["all_gather_into_tensor"] for m in ms)
            rs = statistics.median(m["reduce_scatter_tensor"] for m in ms)
            print(f"| {n} | {ms[0]['bytes'] / 2**20:.1f} | {NAMES.get(series, series)} | {ag:.1f} | {rs:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
