"""Commit cost and recovery of an FSDP2 model under elastic.ShardedState (elastic-run, 4 workers).

    python bench/fsdp_recovery.py                  # width 512, depth 4 (~8.4M parameters; AdamW: ~100 MB)
    python bench/fsdp_recovery.py --width 1024     # ~34M parameters
    python bench/fsdp_recovery.py --kill-at 30 --commit-every 10

One run of bench/_fsdp_recovery_worker.py under ``elastic-run --np W --min-np 2
--max-restarts 0``: the workers train, committing every --commit-every steps; once every
worker passed step --kill-at, one of them is SIGKILLed and the survivors reshard the last
commit onto the smaller world and train on.

  commit cost       mean commit time (each rank's shard copy and the buddy send, plus the
                    membership allreduce every commit has) / (--commit-every x mean step time)
  recovery          from the SIGKILL to the first step completed in the next world: the
                    failure noticed and the ring re-formed, the sync (build, shard, reshard,
                    the new layout committed again), and that step
  moved bytes       what the reshard sent between ranks (rows that changed owner)
  ring bandwidth    bytes per second one ring allgather delivers to each rank, measured by the
                    workers in the same world
  target            0.5 s + moved bytes / ring bandwidth

Nothing is asserted: the numbers are printed (noisy on a shared machine: the load is printed too).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--commit-every", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=25, help="SIGKILL one worker once all passed this step")
    ap.add_argument("--after", type=int, default=5, help="steps the survivors run after the recovery")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="bench-fsdp-recovery-")
    tag = new_tag("fsdp-recovery")
    cmd = [os.path.join(BIN, "elastic-run"), "--np", str(args.workers), "--min-np", "2", "--max-restarts", "0",
           "--", sys.executable, os.path.join(HERE, "_fsdp_recovery_worker.py"), "--run-dir", run_dir,
           "--width", str(args.width), "--depth", str(args.depth), "--commit-every", str(args.commit_every)]
    print(f"# fsdp recovery: {args.workers} workers, width {args.width}, depth {args.depth}, commit every "
          f"{args.commit_every}, {os.cpu_count()} CPUs, load average {load()}", flush=True)
    launch = Launch(cmd, dict(os.environ), tag, os.path.join(run_dir, "launcher.log"))
    try:
        first = wait_for(lambda: [e for e in events(run_dir) if e["ev"] == "world" and e["size"] == args.workers],
                         args.timeout, "first world")[0]
        wait_for(lambda: len({e["pid"] for e in events(run_dir) if e["ev"] == "step" and e["step"] > args.kill_at})
                 == args.workers, args.timeout, f"step {args.kill_at} on every worker")
        victim = sorted(int(p) for p in os.listdir(os.path.join(run_dir, "pids")))[1]
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
    old = [e for e in evs if e.get("v") == first["v"]]
    steps = [e["seconds"] for e in old if e["ev"] == "step" and e["step"] > 2]
    commits = [e["seconds"] for e in old if e["ev"] == "commit"]
    step_s, commit_s = statistics.mean(steps), statistics.mean(commits)
    world = [e for e in evs if e["ev"] == "world" and e["v"] == v]
    moved = max(e["moved"] for e in world)
    bw = statistics.mean(e["bandwidth"] for e in evs if e["ev"] == "bandwidth" and e["v"] == v)
    step_new = min((e for e in evs if e["ev"] == "step" and e["v"] == v), key=lambda e: e["t"])
    recovery = step_new["t"] - t_kill
    formed = min(e["t"] for e in world) - t_kill
    mem = [e for e in old if e["ev"] == "commit"][-1]["memory"]
    print()
    print("| workers | parameters' full state | step | commit (copy + buddy send) | commit cost at every "
          f"{args.commit_every} | per-rank live / own / buddy (of full) |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {args.workers} | {mem['full'] / 1e6:.1f} MB | {step_s * 1e3:.0f} ms | {commit_s * 1e3:.1f} ms "
          f"({mem['own'] / 1e6:.1f} MB) | "
          f"{100 * commit_s / (args.commit_every * step_s):.1f}% | "
          f"{mem['live'] / mem['full']:.2f} / {mem['own'] / mem['full']:.2f} / {mem['buddy'] / mem['full']:.2f} |")
    print()
    print("| SIGKILL of 1 of {0} -> next step in the world of {1} | of which: to the function's restart | sync "
          "(build, shard, reshard, commit) | first step | moved bytes | ring bandwidth | target 0.5 s + moved / "
          "bandwidth |".format(args.workers, world[0]["size"]))
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {recovery:.2f} s | {formed:.2f} s | {max(e['reshard_s'] for e in world):.2f} s | "
          f"{step_new['seconds']:.2f} s | {moved / 1e6:.1f} MB | {bw / 1e6:.0f} MB/s | {0.5 + moved / bw:.2f} s |")
    print(f"# load average {load()} at end")
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
