"""bench/goodput.py's TorchFT job: a lighthouse, one process per replica group, and a restart for each that dies.

    python bench/_torchft_launch.py --run-dir DIR --groups 4 --settings example [--min-replicas 2]

TorchFT leaves restarting a failed replica group to the scheduler (Slurm, Kubernetes, torchx);
here this script is that scheduler. It runs torchft's lighthouse in-process
(torchft.coordination.LighthouseServer, with the flags TorchFT's README starts
``torchft_lighthouse`` with: --quorum_tick_ms 100 --join_timeout_ms 10000, the heartbeat
timeout left at its default; bench/_torchft_settings.py), starts bench/_torchft_worker.py once
per group with --settings and starts a group's worker again whenever it exits, until
SIGTERM/SIGINT or --max-restarts. Each restart is printed ("restart: group G, pid A exited with
STATUS, pid B started").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Dict

from _torchft_settings import JOIN_TIMEOUT_MS, QUORUM_TICK_MS, SETTINGS  # bench/ is this script's directory

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_torchft_worker.py")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the workers' directory (event logs, shard positions)")
    p.add_argument("--groups", type=int, required=True, help="replica groups, one process each")
    p.add_argument("--min-replicas", type=int, default=2,
                   help="the lighthouse's min_replicas and the managers' min_replica_size (default 2)")
    p.add_argument("--max-restarts", type=int, default=100, help="give up after this many restarts (default 100)")
    p.add_argument("--settings", choices=sorted(SETTINGS), required=True,
                   help="the workers' timeouts: example (TorchFT's train_ddp.py) or defaults (the library's)")
    args = p.parse_args()
    if args.groups < 1 or not 1 <= args.min_replicas <= args.groups:
        p.error("need --groups >= 1 and 1 <= --min-replicas <= --groups")

    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.min_replicas, quorum_tick_ms=QUORUM_TICK_MS,
                                  join_timeout_ms=JOIN_TIMEOUT_MS)
    print(f"lighthouse at {lighthouse.address()}", flush=True)
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def start(group: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, WORKER, "--run-dir", args.run_dir, "--group", str(group),
                                 "--groups", str(args.groups), "--lighthouse", lighthouse.address(),
                                 "--min-replicas", str(args.min_replicas), "--settings", args.settings],
                                stdin=subprocess.DEVNULL)

    workers: Dict[int, subprocess.Popen] = {g: start(g) for g in range(args.groups)}
    restarts = 0
    status = 0
    try:
        while not stop["now"]:
            for g, proc in list(workers.items()):
                code = proc.poll()
                if code is None:
                    continue
                if restarts >= args.max_restarts:
                    print(f"giving up: group {g}, pid {proc.pid} exited with {code} after {restarts} restarts",
                          flush=True)
                    status = 1
                    stop["now"] = True
                    break
                restarts += 1
                workers[g] = start(g)
                print(f"restart: group {g}, pid {proc.pid} exited with {code}, pid {workers[g].pid} started",
                      flush=True)
            time.sleep(0.02)
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
        for proc in workers.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        lighthouse.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
