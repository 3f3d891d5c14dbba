"""A small numpy-only training job for the launcher tests (starts fast: no torch import).

It runs as on an install without torch: torch cannot be imported here (unless elastic-run
--preload put it there already), so elastic.run leaves its torch layer out, as it does where
torch is missing, and a worker starts without the seconds of CPU that importing torch takes.

Knobs (environment): LW_OUT directory for pid-<worker>.txt; LW_STEPS steps (default 40);
LW_SLEEP seconds per step (0.05); LW_RAISE_AT raise ValueError at this step on every rank;
LW_RAISE_AFTER_RUN=WORKER that worker raises RuntimeError after the job completed;
LW_EXIT_AFTER_RUN=WORKER:CODE that worker exits with CODE after the job completed;
LW_SKIP_BARRIER=WORKER:SECONDS after the run every worker calls elastic.barrier() on the kept ring
but that worker, which sleeps SECONDS instead (a member that skips the script's final barrier);
LW_RAISE_ON=WORKER:SIZE that worker raises ValueError at its first step in a world of SIZE;
LW_DIVERGE=SLOT:STEP the workers of that slot (every incarnation: a stale image) allreduce one
element more than the others at their first step numbered STEP or later in a world of 3 or more;
LW_PAUSE=RANK:STEP:SECONDS the worker of that rank works alone for SECONDS after STEP (once);
LW_PRINT_ENV=1 prints torchrun's variables at start ("env ...") and at the first step of each
world ("world env ...");
LW_JOIN_AFTER=PATH joins the job only once PATH exists (a test orders joins of two launchers);
LW_PRINT_PRELOADED=1 prints which of elastic, numpy and torch were imported before the script ran
(elastic-run --preload), its parent's pid and its argv;
LW_FINISH_AT=PATH ends training early, at the first step whose allreduce shows PATH existing on any
rank (a test that has seen what it waits for ends the job without running out its LW_STEPS).
Prints "start" first (before any world), "step S size N" after every step, "done" at the end,
then what the worker sees after elastic.run returned: "result R", "after rank R size N
version V", the sum of an allreduce of ones on the last world's ring, and the error a
collective raises once elastic.shutdown() closed that ring.
"""

import sys

# Before this script imports anything: what elastic-run --preload put there (a fork server's modules).
PRELOADED = sorted(m for m in ("elastic", "numpy", "torch") if m in sys.modules)

import importlib.abc  # noqa: E402


class _WithoutTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (tests/launch/worker.py runs without torch)",
                                      name=name)
        return None


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _WithoutTorch())

import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import numpy as np

import elastic

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
OUT = os.environ["LW_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
STEPS = int(os.environ.get("LW_STEPS", "40"))
SLEEP = float(os.environ.get("LW_SLEEP", "0.05"))
RAISE_AT = int(os.environ.get("LW_RAISE_AT", "-1"))
RAISE_ON, _, RAISE_SIZE = os.environ.get("LW_RAISE_ON", "").partition(":")
FINISH_AT = os.environ.get("LW_FINISH_AT", "")
PAUSE = [float(x) for x in os.environ["LW_PAUSE"].split(":")] if os.environ.get("LW_PAUSE") else None
DIVERGE_SLOT, _, DIVERGE_STEP = os.environ.get("LW_DIVERGE", "").partition(":")
SLOT = WORKER.split("-")[1] if WORKER.count("-") >= 1 else ""   # hA-2 and hA-2-r1: slot 2
paused = False   # this process paused already (not state: a restore must not pause it again)

with open(os.path.join(OUT, f"pid-{WORKER}.txt"), "w") as f:
    f.write(str(os.getpid()))
print("start", flush=True)
if os.environ.get("LW_PRINT_PRELOADED"):
    print(f"preloaded {','.join(PRELOADED) or 'nothing'} ppid {os.getppid()} argv {sys.argv}", flush=True)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "MASTER_ADDR")
if os.environ.get("LW_PRINT_ENV"):
    print("env " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in TORCHRUN_VARS), flush=True)
if os.environ.get("LW_JOIN_AFTER"):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["LW_JOIN_AFTER"]):
        if time.monotonic() > deadline:
            sys.exit("LW_JOIN_AFTER: the file never appeared")
        time.sleep(0.02)

state = elastic.ObjectState(step=0, total=0.0)


@elastic.run
def train(state):
    if os.environ.get("LW_PRINT_ENV"):
        print(f"world env rank {elastic.rank()} size {elastic.size()} "
              + " ".join(f"{k}={os.environ.get(k, '-')}" for k in TORCHRUN_VARS), flush=True)
    while state.step < STEPS:
        if state.step == RAISE_AT or (RAISE_ON == WORKER and str(elastic.size()) == RAISE_SIZE):
            raise ValueError(f"deterministic user error at step {state.step}")
        # The finish flag rides on the step's allreduce: every rank ends after the same step.
        finish = 1.0 if FINISH_AT and os.path.exists(FINISH_AT) else 0.0
        ones = [1, 1, 1, 1]
        if SLOT == DIVERGE_SLOT and state.step >= int(DIVERGE_STEP) and elastic.size() >= 3:
            ones.append(1)   # one element more: another collective than the others'
        summed = elastic.allreduce(np.array([*ones, finish], dtype=np.float32), elastic.Sum)
        state.total += float(summed[0])
        state.step += 1
        print(f"step {state.step} size {elastic.size()}", flush=True)
        if summed[4] > 0:
            print(f"finishing early at step {state.step}", flush=True)
            break
        global paused
        if PAUSE and not paused and elastic.rank() == PAUSE[0] and state.step == PAUSE[1]:
            paused = True
            print(f"working alone for {PAUSE[2]:g} s", flush=True)
            time.sleep(PAUSE[2])   # evaluation, a checkpoint: this rank is busy, not hung
        time.sleep(SLEEP)
        if state.step % 2 == 0:
            state.commit()
    return state.total


result = train(state)
print("done", flush=True)
print(f"result {result}", flush=True)
print(f"after rank {elastic.rank()} size {elastic.size()} version {elastic.world_version()}", flush=True)
skipper, _, skip_s = os.environ.get("LW_SKIP_BARRIER", "").partition(":")
if skipper == WORKER:
    time.sleep(float(skip_s))
elif skipper:
    elastic.barrier()   # raises when a member never comes, as torch's barrier does on its timeout
try:
    total = elastic.allreduce(np.ones(1, dtype=np.float32), op=elastic.Sum)   # on the last world's ring
    print(f"collective after run: {float(total[0]):g}", flush=True)
except elastic.ElasticError as e:
    print(f"collective after run: {type(e).__name__}: {e}", flush=True)
elastic.shutdown()   # closes that ring
try:
    elastic.allreduce(np.ones(1, dtype=np.float32))
    print("collective after shutdown: ran", flush=True)
except elastic.RendezvousError as e:
    print(f"collective after shutdown: {type(e).__name__}: {e}", flush=True)
if os.environ.get("LW_RAISE_AFTER_RUN") == WORKER:
    raise RuntimeError("failed after training")
after, _, code = os.environ.get("LW_EXIT_AFTER_RUN", "").partition(":")
if after == WORKER:
    sys.exit(int(code))
