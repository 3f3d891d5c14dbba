"""A small numpy-only training job for the launcher tests (starts fast: no torch import).

Knobs (environment): LW_OUT directory for pid-<worker>.txt; LW_STEPS steps (default 40);
LW_SLEEP seconds per step (0.05); LW_RAISE_AT raise ValueError at this step on every rank;
LW_RAISE_AFTER_RUN=WORKER that worker raises RuntimeError after the job completed;
LW_EXIT_AFTER_RUN=WORKER:CODE that worker exits with CODE after the job completed.
Prints "start" first (before any world), "step S size N" after every step, "done" at the end,
then what the worker sees after elastic.run returned: "result R", "after rank R size N
version V", and the class of the error a collective raises then.
"""

import logging
import os
import sys
import time

import numpy as np

import elastic

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
OUT = os.environ["LW_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
STEPS = int(os.environ.get("LW_STEPS", "40"))
SLEEP = float(os.environ.get("LW_SLEEP", "0.05"))
RAISE_AT = int(os.environ.get("LW_RAISE_AT", "-1"))

with open(os.path.join(OUT, f"pid-{WORKER}.txt"), "w") as f:
    f.write(str(os.getpid()))
print("start", flush=True)

state = elastic.ObjectState(step=0, total=0.0)


@elastic.run
def train(state):
    while state.step < STEPS:
        if state.step == RAISE_AT:
            raise ValueError(f"deterministic user error at step {state.step}")
        ones = elastic.allreduce(np.ones(4, dtype=np.float32), elastic.Sum)
        state.total += float(ones[0])
        state.step += 1
        print(f"step {state.step} size {elastic.size()}", flush=True)
        time.sleep(SLEEP)
        if state.step % 2 == 0:
            state.commit()
    return state.total


result = train(state)
print("done", flush=True)
print(f"result {result}", flush=True)
print(f"after rank {elastic.rank()} size {elastic.size()} version {elastic.world_version()}", flush=True)
try:
    elastic.allreduce(np.ones(1, dtype=np.float32))
    print("collective after run: ran", flush=True)
except elastic.RendezvousError as e:
    print(f"collective after run: {type(e).__name__}: {e}", flush=True)
if os.environ.get("LW_RAISE_AFTER_RUN") == WORKER:
    raise RuntimeError("failed after training")
after, _, code = os.environ.get("LW_EXIT_AFTER_RUN", "").partition(":")
if after == WORKER:
    sys.exit(int(code))
