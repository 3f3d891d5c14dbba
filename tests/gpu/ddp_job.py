"""A small DDP training job on the world's device communicator, for the device tests and bench/gpu_check.py.

On a GPU (GJ_DEVICE=cuda) the model, its gradients and the collectives are on CUDA and the
device communicator is NCCL; on the CPU (ELASTIC_DEVICE_BACKEND=gloo) gloo stands in for it and
the same code runs its DDP buckets, its broadcasts and its ``dist.all_reduce`` on gloo.

Knobs (environment): GJ_OUT directory for pid-<worker>.txt and state-<worker>.pt; GJ_DEVICE
(cpu, cuda); GJ_STEPS (60); GJ_SLEEP seconds per step (0.05); GJ_COMMIT_EVERY (1);
GJ_FINISH_AT=PATH ends training at the first step whose allreduce sees PATH on any rank;
GJ_STUCK_ABORT=SLOT the worker of that slot (its first incarnation) gets a backend whose abort
never returns; GJ_HOSTID=1 gives each process its own NCCL_HOSTID (several ranks on one GPU);
GJ_WIDTH (64) the model's width; GJ_LEAVE=WORKER:STEP that worker asks to leave (elastic.request_leave)
after that step (or the first it runs after it). Prints "step S size N loss L at T" after each step (T: seconds
since the epoch, for recovery times), "state <sha256>" of the model and optimizer at the end.
"""

import hashlib
import os
import time

if os.environ.get("GJ_HOSTID"):
    # NCCL refuses two ranks on one GPU unless each process has a host id of its own; then they
    # meet over its socket transport (bench/gpu_check.py on one GPU).
    os.environ["NCCL_HOSTID"] = f"gj-{os.environ.get('ELASTIC_WORKER_ID', os.getpid())}-{os.getpid()}"

import torch
import torch.distributed as dist

import elastic
from elastic.torchdist import device_backend

OUT = os.environ["GJ_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
DEVICE = os.environ.get("GJ_DEVICE", "cpu")
STEPS = int(os.environ.get("GJ_STEPS", "60"))
SLEEP = float(os.environ.get("GJ_SLEEP", "0.05"))
COMMIT_EVERY = int(os.environ.get("GJ_COMMIT_EVERY", "1"))
FINISH_AT = os.environ.get("GJ_FINISH_AT") or os.environ.get("LW_FINISH_AT", "")   # LW_: tests/launch's helper
WIDTH = int(os.environ.get("GJ_WIDTH", "64"))
LEAVER, _, LEAVE_STEP = os.environ.get("GJ_LEAVE", ":0").partition(":")
ASKED = []

if os.environ.get("GJ_STUCK_ABORT", "") == os.environ.get("ELASTIC_LOCAL_SLOT") and \
        os.environ.get("ELASTIC_RESTART_COUNT") == "0":
    def _never_returns(self):
        time.sleep(3600)
    device_backend.TorchBackend.abort = _never_returns   # this process's backends only

with open(os.path.join(OUT, f"pid-{WORKER}.txt"), "w") as f:
    f.write(str(os.getpid()))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1)).to(DEVICE)
ddp = elastic.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
state = elastic.TorchState(model=model, optimizer=opt, step=0)


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, WIDTH, generator=g)
    return x.to(DEVICE), x.sum(dim=1, keepdim=True).to(DEVICE)


@elastic.run
def train(state):
    while state.step < STEPS:
        x, y = data(state.step, elastic.rank())
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        # A plain dist.all_reduce on the device tensors: the default group under elastic.run.
        flags = torch.tensor([loss.item(), 1.0 if FINISH_AT and os.path.exists(FINISH_AT) else 0.0], device=DEVICE)
        dist.all_reduce(flags)
        print(f"step {state.step} size {elastic.size()} loss {flags[0].item() / elastic.size():.6f} "
              f"at {time.time():.3f}", flush=True)
        if WORKER == LEAVER and state.step >= int(LEAVE_STEP) and not ASKED:
            ASKED.append(state.step)   # it may have joined after that step: the first step it runs from then
            elastic.request_leave()    # leaves at the commit below
        if state.step % COMMIT_EVERY == 0:
            state.commit()
        if flags[1].item() > 0:
            state.commit()
            return
        time.sleep(SLEEP)


train(state)
h = hashlib.sha256()
for t in list(model.state_dict().values()) + [v for s in opt.state_dict()["state"].values() for v in s.values()
                                               if isinstance(v, torch.Tensor)]:
    h.update(t.detach().cpu().contiguous().numpy().tobytes())
print(f"state {h.hexdigest()} step {state.step}", flush=True)
