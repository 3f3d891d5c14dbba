"""A numpy-only job for the straggler tests: steps of fixed "compute" (a sleep, so that four workers
on two shared cores do not compete for the CPU), an allreduce each, a commit every two steps.

A test slows a worker from outside (SIGSTOP/SIGCONT duty cycles on the pid it writes to
LW_OUT/pid-<worker>.txt); the job itself does nothing different. Knobs (environment):
LW_COMPUTE_S seconds of compute per step (0.02); LW_ALONE=STEP:SECONDS rank 0 works alone that
long once, after that step (an evaluation between commits); LW_STOP: a path; when it exists at
a commit, every rank agrees (one more allreduce) to stop. Prints "step S size N" after every
step (S counts every step of the job: a restored commit would print some twice) and "done".
"""

import os
import time

import numpy as np

import elastic

OUT = os.environ["LW_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
COMPUTE_S = float(os.environ.get("LW_COMPUTE_S", "0.02"))
ALONE = [float(x) for x in os.environ["LW_ALONE"].split(":")] if os.environ.get("LW_ALONE") else None
STOP = os.environ["LW_STOP"]
alone_done = False   # this process worked alone already (not state: a restore must not repeat it)

with open(os.path.join(OUT, f"pid-{WORKER}.txt"), "w") as f:
    f.write(str(os.getpid()))

state = elastic.ObjectState(step=0)


@elastic.run
def train(state):
    global alone_done
    while True:
        time.sleep(COMPUTE_S)
        elastic.allreduce(np.ones(256, dtype=np.float32), elastic.Sum)
        state.step += 1
        print(f"step {state.step} size {elastic.size()}", flush=True)
        if ALONE and not alone_done and elastic.rank() == 0 and state.step >= ALONE[0]:
            alone_done = True
            print(f"working alone for {ALONE[1]:g} s", flush=True)
            time.sleep(ALONE[1])
        if state.step % 2 == 0:
            state.commit()
            stop = elastic.allreduce(np.array([float(os.path.exists(STOP))]), elastic.Max)
            if stop[0]:
                return state.step


train(state)
print("done", flush=True)
