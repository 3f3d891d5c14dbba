"""Worker for tests/launch/test_commits_readable.py: jobs that commit too seldom, never, or to disk.

    python commit_job.py no-commit      # trains LW_STEPS steps of a TorchState, never commits
    python commit_job.py durable-last   # commits every step, durable every 4th, into LW_CKPT
    python commit_job.py never-commits  # a state that always restores, no commit; waits to be killed
"""
import os
import sys
import time

import torch

import elastic

MODE = sys.argv[1]
OUT = os.environ["LW_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
STEPS = int(os.environ.get("LW_STEPS", "30"))

with open(os.path.join(OUT, f"pid-{WORKER}.txt"), "w") as f:
    f.write(str(os.getpid()))

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def one_step():
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        elastic.allreduce_(p.grad, op=elastic.Average)
    opt.step()


if MODE == "no-commit":
    state = elastic.TorchState(model=model, optimizer=opt, step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            one_step()
            state.step += 1
        print(f"trained {state.step} steps", flush=True)

elif MODE == "durable-last":
    state = elastic.TorchState(model=model, optimizer=opt, step=0)

    @elastic.run(checkpoint_dir=os.environ["LW_CKPT"], checkpoint_every=4)
    def train(state):
        while state.step < STEPS:
            one_step()
            state.step += 1
            state.commit()
        print(f"trained {state.step} steps", flush=True)

elif MODE == "never-commits":
    state = elastic.ObjectState(step=0)   # no model followed: a failure always restores

    @elastic.run
    def train(state):
        while state.step < STEPS:
            elastic.allreduce(torch.ones(1))
            state.step += 1
            print(f"step {state.step} size {elastic.size()}", flush=True)
            time.sleep(0.05)

train(state)
