"""The systems bench/goodput.py compares: each one's command line, environment and settings, with their sources.

One home for what each system runs, so that the runs and the configuration goodput.py prints
at the top of its output cannot drift apart. Each system runs as its own documentation says a
fault-tolerant job should:

  torchrun          torchrun --standalone --max-restarts R, gloo DDP, a checkpoint every
                    --commit-every steps loaded at every (re)start: torchrun's documented
                    fault tolerance (docs.pytorch.org/docs/stable/elastic/train_script.html).
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's default (the rendezvous
                    TCPStore shared with the workers) a restarted worker group reads the
                    previous group's gloo addresses and every restart fails in connectFullMesh
                    ("Connection refused"); the variable is the opt-out the maintainers give in
                    pytorch/pytorch#135712. Everything else at torchrun's and torch's defaults
                    (--monitor-interval 0.1 s; init_process_group("gloo") with its 30 min
                    timeout, which a restart never waits out: the agent kills the group).
  elastic-run       elastic-run --np W --min-np 2 --max-restarts R; its defaults otherwise
                    (heartbeat timeout 1.2 s, collective timeout 1800 s).
  torchft           TorchFT with the timeouts and checkpoint transport of its own DDP example,
                    train_ddp.py (bench/_torchft_settings.py names file and line of each).
  torchft-defaults  the same job with TorchFT's library defaults (60 s timeouts, state over
                    HTTP): what a user gets who sets none; shown beside the example's row
                    because the two recover from a SIGKILL in very different times.

W workers; R = the faults planned for the run + 3. Every system runs with OMP_NUM_THREADS=1
(and the workers call torch.set_num_threads(1)).
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Dict, List

from _torchft_settings import DEFAULTS, EXAMPLE, describe, lighthouse_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)   # torchrun and elastic-run of this environment
WORKER = os.path.join(REPO, "bench", "_goodput_worker.py")
TORCHFT_LAUNCH = os.path.join(REPO, "bench", "_torchft_launch.py")
LAUNCHERS = ("torchrun", "elastic-run", "torchft", "torchft-defaults")
TORCHFT = {"torchft": EXAMPLE, "torchft-defaults": DEFAULTS}
# torchrun's c10d rendezvous shares its TCPStore with the workers by default, and a restarted
# worker group then reads the previous group's gloo addresses from it: every restart fails in
# connectFullMesh ("Connection refused"; pytorch/pytorch#135712). Its documented opt-out is set
# for the torchrun runs unless the caller set it, so that torchrun can restart at all.
TORCH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

TITLES = {"torchrun": "torchrun (gloo DDP, checkpoint to disk)",
          "elastic-run": "elastic-run (elastic DDP, commit)",
          "torchft": "TorchFT (example settings: gloo 5 s, Manager 30 s)",
          "torchft-defaults": "TorchFT (library defaults: 60 s timeouts)"}
FSDP_TITLES = {"torchrun": "torchrun (FSDP2 over gloo, DCP checkpoint)",
               "elastic-run": "elastic-run (ShardedState, commit)"}


def command(launcher: str, args, run_dir: str, restarts) -> List[str]:
    """The launcher's command line for a run in ``run_dir`` that may restart ``restarts`` times."""
    common = ["--run-dir", run_dir, "--commit-every", str(args.commit_every)] + (["--fsdp"] if args.fsdp else [])
    if launcher == "torchrun":
        return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", str(args.workers),
                "--max-restarts", str(restarts), WORKER, "--launcher", "torchrun",
                "--checkpoint", os.path.join(run_dir, "checkpoint" if args.fsdp else "checkpoint.pt"), *common]
    if launcher in TORCHFT:
        # TorchFT commits every step: --commit-every has nothing to set.
        return [sys.executable, TORCHFT_LAUNCH, "--run-dir", run_dir, "--groups", str(args.workers),
                "--min-replicas", "2", "--max-restarts", str(restarts), "--settings", TORCHFT[launcher].name]
    return [os.path.join(BIN, "elastic-run"), "--np", str(args.workers), "--min-np", "2",
            "--max-restarts", str(restarts), *(["--preload", args.preload] if args.preload else []),
            "--", sys.executable, WORKER, "--launcher", "elastic", *common]


def environment(launcher: str) -> Dict[str, str]:
    """The variables the bench sets for ``launcher`` beyond its own plumbing (tag, deadline, path)."""
    env = {"OMP_NUM_THREADS": "1"}
    if launcher == "torchrun":
        env[TORCH_STORE_ENV] = os.environ.get(TORCH_STORE_ENV, "1")
    return env


def shown(cmd: List[str]) -> str:
    """A command line as a reader would type it in the repository: programs of this environment
    by name, paths under the repository relative to it."""
    words = []
    for word in cmd:
        if word == sys.executable:
            word = "python"
        elif os.path.dirname(word) == BIN:
            word = os.path.basename(word)
        elif word.startswith(REPO + os.sep):
            word = os.path.relpath(word, REPO)
        words.append(shlex.quote(word))
    return " ".join(words)


def configuration(args) -> List[str]:
    """What every system of this run runs, one block each: enough to rerun any row by hand."""
    lines = [f"configuration: {args.workers} workers; DIR = a fresh run directory; R = the faults planned + 3; "
             "the bench also sets BENCH_TAG, BENCH_DEADLINE (its process tag and the workers' watchdog) and "
             "PYTHONPATH=<this repository>"]
    for launcher in args.launchers:
        env = " ".join(f"{k}={v}" for k, v in environment(launcher).items())
        title = (FSDP_TITLES if args.fsdp else TITLES)[launcher]
        lines.append(f"{title}:")
        lines.append(f"  {env} {shown(command(launcher, args, 'DIR', 'R'))}")
        if launcher == "torchrun":
            lines.append(f"  set: {TORCH_STORE_ENV}=1 (the opt-out pytorch/pytorch#135712 gives: with torch's default "
                         "no restart succeeds); a checkpoint every --commit-every steps, loaded at every start "
                         "(torchrun's documented fault tolerance: docs.pytorch.org, elastic/train_script)")
            lines.append("  not set (defaults): --monitor-interval (0.1 s), init_process_group(\"gloo\")'s timeout "
                         "(30 min; a failure ends the group through the agent, not the timeout), DDP's buckets (25 MB)")
        elif launcher == "elastic-run":
            lines.append("  not set (defaults): the heartbeat timeout (1.2 s), --collective-timeout (1800 s)")
        else:
            lines.append(f"  lighthouse: {lighthouse_line(2)}")
            lines.extend(("  each replica group: " if i < 2 else "  ") + line
                         for i, line in enumerate(describe(TORCHFT[launcher], 2)))
    return lines
