"""Commit cost and recovery of an FSDP2 model under elastic.ShardedState (elastic-run, 4 workers).

    python bench/fsdp_recovery.py                  # width 512, depth 4 (~8.4M parameters; AdamW: ~100 MB)
    python bench/fsdp_recovery.py --repeat 5       # five jobs, one SIGKILL each, one row each
    python bench/fsdp_recovery.py --meta-build     # build() on the meta device once a commit is held
    python bench/fsdp_recovery.py --width 1024     # ~34M parameters

Each run is bench/_fsdp_recovery_worker.py under ``elastic-run --np W --min-np 2
--max-restarts 0``: the workers train, committing every --commit-every steps; once every
worker passed step --kill-at, rank --victim-rank is SIGKILLed and the
survivors reshard the last commit onto the smaller world and train on.

  commit cost       mean commit time (each rank's shard copy and the buddy send, plus the
                    membership allreduce every commit has) / (--commit-every x mean step time)
  recovery          from the SIGKILL to the first step completed in the next world, and to
                    the moment training resumed (the sync done, the first step starting)
  moved bytes       the most one rank received in the reshard (the rows that change owner
                    travel point to point: the rows it takes, and any it passes on)
  to buddies        what the commit of the new layout sent to the buddies (the rows each did
                    not hold already), against whole copies of that layout
  ring bandwidth    bytes per second one ring allgather delivers to each rank, measured by the
                    workers in the same world
  target            0.5 s + moved bytes / ring bandwidth
  where it went     when the failure surfaced in a survivor and when the next ring was formed
                    (elastic's own log lines, timed), then the sync's phases on the slowest
                    rank: agree (who holds which commit), build, shard (+ optimizer), replicated
                    (the root's attributes, buffers and settings), move (the rows that change
                    owner, assembled straight into the new own copy), load (into the live
                    model and optimizer), copy, buddy (the new layout's copy sent to the
                    buddy), agreement (the commit's closing allreduce)

Only elastic-run runs here; torchrun with DCP checkpoints on the same kind of sharded job is
bench/goodput.py --fsdp. Nothing is asserted: the numbers are printed (noisy on a shared
machine: the load is printed too).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import Launch, new_tag  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)


def events(run_dir: str) -> list:
    out = []
    for path in glob.glob(os.path.join(run_dir, "events-*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return sorted(out, key=lambda e: e["t"])


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout:g} s")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


PHASES = ("agree", "build", "shard", "replicated", "move", "load", "copy", "buddy", "agreement")


def one_run(args) -> dict:
    """One job: train, SIGKILL a worker after --kill-at, measure the recovery; the figures."""
    run_dir = tempfile.mkdtemp(prefix="bench-fsdp-recovery-")
    tag = new_tag("fsdp-recovery")
    cmd = [os.path.join(BIN, "elastic-run"), "--np", str(args.workers), "--min-np", "2", "--max-restarts", "0",
           "--", sys.executable, os.path.join(HERE, "_fsdp_recovery_worker.py"), "--run-dir", run_dir,
           "--width", str(args.width), "--depth", str(args.depth), "--commit-every", str(args.commit_every)]
    if args.meta_build:
        cmd.append("--meta-build")
    launch = Launch(cmd, dict(os.environ), tag, os.path.join(run_dir, "launcher.log"))
    try:
        first = wait_for(lambda: [e for e in events(run_dir) if e["ev"] == "world" and e["size"] == args.workers],
                         args.timeout, "first world")[0]
        wait_for(lambda: len({e["pid"] for e in events(run_dir) if e["ev"] == "step" and e["step"] > args.kill_at})
                 == args.workers, args.timeout, f"step {args.kill_at} on every worker")
        ranks = {e["rank"]: e["pid"] for e in events(run_dir) if e["ev"] == "world" and e["v"] == first["v"]}
        victim = ranks[args.victim_rank % args.workers]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        new = wait_for(lambda: [e for e in events(run_dir) if e["ev"] == "world" and e["v"] > first["v"]],
                       args.timeout, "next world")
        v = new[0]["v"]
        steps_new = wait_for(lambda: [e for e in events(run_dir) if e["ev"] == "step" and e["v"] == v],
                             args.timeout, "a step in the next world")
        wait_for(lambda: [e for e in events(run_dir) if e["ev"] == "step" and e["v"] == v
                          and e["step"] >= steps_new[0]["step"] + args.after], args.timeout, "steps after recovery")
        wait_for(lambda: [e for e in events(run_dir) if e["ev"] == "bandwidth" and e["v"] == v], args.timeout,
                 "the ring bandwidth")
    finally:
        launch.close(grace=0)
    evs = events(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    old = [e for e in evs if e.get("v") == first["v"]]
    world = [e for e in evs if e["ev"] == "world" and e["v"] == v]
    logs = [e for e in evs if e["ev"] == "log" and e["t"] >= t_kill and e["pid"] != victim]
    noticed = [e["t"] for e in logs if "failed at world version" in e["msg"] or "closed" in e["msg"]]
    formed = [e["t"] for e in logs if f"in world version {v} (formed" in e["msg"]]
    step_new = min((e for e in evs if e["ev"] == "step" and e["v"] == v), key=lambda e: e["t"])
    later_evs = sorted((e for e in evs if e["ev"] == "step" and e["v"] == v and e["step"] > step_new["step"]),
                       key=lambda e: e["seconds"])
    later = [e["seconds"] for e in later_evs]
    return {
        "size": world[0]["size"],
        "step": statistics.mean(e["seconds"] for e in old if e["ev"] == "step" and e["step"] > 2),
        "commit": statistics.mean(e["seconds"] for e in old if e["ev"] == "commit"),
        "memory": [e for e in old if e["ev"] == "commit"][-1]["memory"],
        "recovery": step_new["t"] - t_kill,
        "resumed": max(e["t"] for e in world) - t_kill,
        "noticed": (min(noticed) - t_kill) if noticed else float("nan"),
        "formed": (max(formed) - t_kill) if formed else float("nan"),
        "sync": max(e["reshard_s"] for e in world),
        "phases": {k: max(e["phases"].get(k, 0.0) for e in world) for k in PHASES},
        "first_step": step_new["seconds"],
        "first_parts": step_new["parts"],
        "later_step": later[len(later) // 2] if later else float("nan"),
        "later_parts": later_evs[len(later_evs) // 2]["parts"] if later_evs else [float("nan")] * 3,
        "moved": max(e["moved"] for e in world),
        "to_buddies": sum(e["buddy"] for e in world),
        "whole_copies": sum(e["own"] for e in world),
        "bandwidth": statistics.mean(e["bandwidth"] for e in evs if e["ev"] == "bandwidth" and e["v"] == v),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--commit-every", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=25, help="SIGKILL one worker once all passed this step")
    ap.add_argument("--after", type=int, default=5, help="steps the survivors run after the recovery")
    ap.add_argument("--repeat", type=int, default=1, help="jobs to run (one SIGKILL each), one row each")
    ap.add_argument("--victim-rank", type=int, default=3,
                    help="the rank to kill (which decides the bytes that move: none for rank 0, half the state for "
                         "the last rank of 4)")
    ap.add_argument("--meta-build", action="store_true",
                    help="the workers' build() makes the model on the meta device once they hold a commit")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    print(f"# fsdp recovery: {args.workers} workers, width {args.width}, depth {args.depth}, commit every "
          f"{args.commit_every}, rank {args.victim_rank} killed, {os.cpu_count()} CPUs, load average {load()}",
          flush=True)
    runs = []
    for i in range(args.repeat):
        runs.append(one_run(args))
        print(f"# run {i + 1} of {args.repeat} done, load average {load()}", flush=True)
    print()
    print("| workers | parameters' full state | step | commit (copy + buddy send) | commit cost at every "
          f"{args.commit_every} | per-rank live / own / buddy (of full) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        mem = r["memory"]
        print(f"| {args.workers} | {mem['full'] / 1e6:.1f} MB | {r['step'] * 1e3:.0f} ms | {r['commit'] * 1e3:.1f} ms "
              f"({mem['own'] / 1e6:.1f} MB) | {100 * r['commit'] / (args.commit_every * r['step']):.1f}% | "
              f"{mem['live'] / mem['full']:.2f} / {mem['own'] / mem['full']:.2f} / {mem['buddy'] / mem['full']:.2f} |")
    print()
    print(f"| SIGKILL of 1 of {args.workers} -> first step done in the next world | -> training resumed (sync "
          "done) | moved bytes | to buddies (of whole copies) | ring bandwidth | target 0.5 s + moved / bandwidth | "
          "first step (a later one) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['recovery']:.2f} s | {r['resumed']:.2f} s | {r['moved'] / 1e6:.1f} MB | "
              f"{r['to_buddies'] / 1e6:.1f} MB ({r['whole_copies'] / 1e6:.1f} MB) | "
              f"{r['bandwidth'] / 1e6:.0f} MB/s | {0.5 + r['moved'] / r['bandwidth']:.2f} s | "
              f"{r['first_step']:.2f} s ({r['later_step']:.2f} s) |")
    print()
    print("Where the time went (seconds after the SIGKILL; sync phases: the slowest rank's):")
    print()
    print("| failure surfaced | ring re-formed | sync | " + " | ".join(PHASES) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in PHASES) + " |")
    for r in runs:
        print(f"| {r['noticed']:.2f} | {r['formed']:.2f} | {r['sync']:.3f} | "
              + " | ".join(f"{r['phases'][k]:.3f}" for k in PHASES) + " |")
    for r in runs:
        print("# first step: forward %.3f, backward %.3f, optimizer %.3f; a later one (the median): %.3f, %.3f, %.3f"
              % (tuple(r["first_parts"]) + tuple(r["later_parts"])))
    print(f"# load average {load()} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
