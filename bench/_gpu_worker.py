"""One rank of bench/gpu_check.py and of tests/gpu: DDP, allreduce checks and torch's own DDP, on GPUs or on gloo.

    elastic-run --np 4 --gpus-per-host 0 -- python bench/_gpu_worker.py ddp        # elastic DDP
    elastic-run --np 2 --gpus-per-host 0 -- python bench/_gpu_worker.py collectives  # init + collectives checked
    torchrun --standalone --nproc-per-node 4 bench/_gpu_worker.py torch-ddp        # torch's own DDP

On a GPU (GJ_DEVICE=cuda) the model, its gradients and the collectives are on CUDA and the
device communicator is NCCL; on the CPU (GJ_DEVICE=cpu, ELASTIC_DEVICE_BACKEND=gloo) gloo stands
in for it and the same code runs its DDP buckets, its broadcasts and its ``dist.all_reduce`` on
gloo. ``torch-ddp`` runs the same loop on torch's NCCL (gloo on the CPU) group under torchrun,
without commits: the baseline of the steps/s comparison.

Knobs (environment): GJ_OUT directory for pid-<worker>.txt; GJ_DEVICE (cpu, cuda); GJ_STEPS
(60); GJ_SLEEP seconds per step (0.05); GJ_COMMIT_EVERY (1); GJ_FINISH_AT=PATH (or LW_FINISH_AT,
tests/launch's helper) ends training at the first step whose allreduce sees PATH on any rank;
GJ_STUCK_ABORT=SLOT the worker of that slot (its first incarnation) gets a backend whose abort
never returns; GJ_HOSTID=1 gives each process its own NCCL_HOSTID (several ranks on one GPU);
GJ_WIDTH (64) the model's width; GJ_BATCH (32); GJ_LEAVE=WORKER:STEP that worker asks to leave
(elastic.request_leave) after that step (or the first it runs after it). Prints "step S size N
loss L at T" after each step (T: seconds since the epoch, for recovery times), "mem world V
used U reserved R" at the first step of each world (bytes: the device's used memory, this
process's reserved; the process's resident memory on the CPU), "state <sha256> step S" of the
model and optimizer at the end.
"""

import hashlib
import os
import sys
import time

MODE = sys.argv[1] if len(sys.argv) > 1 else "ddp"
if os.environ.get("GJ_HOSTID"):
    # NCCL refuses two ranks on one GPU unless each process has a host id of its own; then they
    # meet over its socket transport (bench/gpu_check.py on one GPU).
    os.environ["NCCL_HOSTID"] = f"gj-{os.environ.get('ELASTIC_WORKER_ID', os.environ.get('RANK', ''))}-{os.getpid()}"

import torch
import torch.distributed as dist

DEVICE = os.environ.get("GJ_DEVICE", "cpu")
STEPS = int(os.environ.get("GJ_STEPS", "60"))
SLEEP = float(os.environ.get("GJ_SLEEP", "0.05"))
COMMIT_EVERY = int(os.environ.get("GJ_COMMIT_EVERY", "1"))
FINISH_AT = os.environ.get("GJ_FINISH_AT") or os.environ.get("LW_FINISH_AT", "")
WIDTH = int(os.environ.get("GJ_WIDTH", "64"))
BATCH = int(os.environ.get("GJ_BATCH", "32"))


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
    return model.to(DEVICE)


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x.to(DEVICE), x.sum(dim=1, keepdim=True).to(DEVICE)


def one_step(ddp, opt, step: int, rank: int, size: int, prefix: str = "") -> bool:
    """Forward, backward, the optimizer's step, and one dist.all_reduce of the loss and the finish
    flag (the default group: under elastic.run, the elastic group); True: finish now."""
    x, y = data(step, rank)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    flags = torch.stack([loss.detach(), torch.tensor(1.0 if FINISH_AT and os.path.exists(FINISH_AT) else 0.0,
                                                      device=DEVICE)])
    dist.all_reduce(flags)
    print(f"{prefix}step {step + 1} size {size} loss {flags[0].item() / size:.6f} at {time.time():.3f}", flush=True)
    return flags[1].item() > 0


def memory_line(version: int) -> str:
    if DEVICE == "cuda":
        free, total = torch.cuda.mem_get_info()
        return f"mem world {version} used {total - free} reserved {torch.cuda.memory_reserved()}"
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return f"mem world {version} used {resident} reserved 0"


def state_line(model, opt, step: int) -> str:
    h = hashlib.sha256()
    tensors = list(model.state_dict().values()) + [v for s in opt.state_dict()["state"].values()
                                                    for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return f"state {h.hexdigest()} step {step}"


def elastic_ddp() -> None:
    import elastic
    from elastic.torchdist import device_backend

    worker = os.environ["ELASTIC_WORKER_ID"]
    leaver, _, leave_step = os.environ.get("GJ_LEAVE", ":0").partition(":")
    asked, worlds = [], []
    if os.environ.get("GJ_STUCK_ABORT", "") == os.environ.get("ELASTIC_LOCAL_SLOT") and \
            os.environ.get("ELASTIC_RESTART_COUNT") == "0":
        def never_returns(self):
            time.sleep(3600)
        device_backend.TorchBackend.abort = never_returns   # this process's backends only
    with open(os.path.join(os.environ["GJ_OUT"], f"pid-{worker}.txt"), "w") as f:
        f.write(str(os.getpid()))

    model = build()
    ddp = elastic.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = elastic.TorchState(model=model, optimizer=opt, step=0)

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if not worlds or worlds[-1] != elastic.world_version():
                worlds.append(elastic.world_version())
                print(memory_line(worlds[-1]), flush=True)
            finish = one_step(ddp, opt, state.step, elastic.rank(), elastic.size())
            state.step += 1
            if worker == leaver and state.step >= int(leave_step) and not asked:
                asked.append(state.step)   # it may have joined after that step: the first step it runs from then
                elastic.request_leave()    # leaves at the commit below
            if state.step % COMMIT_EVERY == 0 or finish:
                state.commit()
            if finish:
                return
            time.sleep(SLEEP)

    train(state)
    print(state_line(model, opt, state.step), flush=True)


def _value(rank: int, n: int = 5) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) * (rank + 1) - rank).to(DEVICE)


def collectives_checked(rank: int, size: int) -> dict:
    """Each tensor collective of the elastic group on device tensors, against the answer torch
    gives: name -> True, or what was wrong."""
    got = {}
    every = [_value(r) for r in range(size)]
    for name, op, ref in [("sum", dist.ReduceOp.SUM, sum(every)), ("avg", dist.ReduceOp.AVG, sum(every) / size),
                          ("max", dist.ReduceOp.MAX, torch.stack(every).max(0).values)]:
        t = _value(rank)
        dist.all_reduce(t, op=op)
        got[f"all_reduce {name}"] = torch.allclose(t, ref)
    big = torch.full((1 << 20,), float(rank + 1), device=DEVICE)
    dist.all_reduce(big)
    got["all_reduce 4 MiB"] = bool((big == size * (size + 1) / 2).all())
    t = _value(rank)
    w = dist.all_reduce(t, async_op=True)
    got["async wait"] = w.wait() is True and torch.allclose(t, sum(every))
    for root in range(size):
        b = _value(rank)
        dist.broadcast(b, src=root)
        got[f"broadcast from {root}"] = torch.equal(b, every[root])
    outs = [torch.empty(5, device=DEVICE) for _ in range(size)]
    dist.all_gather(outs, _value(rank))
    got["all_gather"] = all(torch.equal(o, e) for o, e in zip(outs, every))
    out = torch.empty(size * 5, device=DEVICE)
    dist.all_gather_into_tensor(out, _value(rank))
    got["all_gather_into_tensor"] = torch.equal(out, torch.cat(every))
    mine = torch.empty(5, device=DEVICE)
    dist.reduce_scatter(mine, [_value(rank) + j for j in range(size)])
    got["reduce_scatter"] = torch.allclose(mine, sum(every) + size * rank)
    mine = torch.empty(2, device=DEVICE)
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * size, device=DEVICE) * (rank + 1))
    got["reduce_scatter_tensor"] = torch.allclose(
        mine, torch.arange(2.0 * rank, 2.0 * rank + 2, device=DEVICE) * (size * (size + 1) / 2))
    ins = [torch.tensor([float(rank * 10 + j)], device=DEVICE) for j in range(size)]
    outs = [torch.empty(1, device=DEVICE) for _ in range(size)]
    dist.all_to_all(outs, ins)
    got["all_to_all"] = [o.item() for o in outs] == [float(r * 10 + rank) for r in range(size)]
    recv = torch.empty(size, device=DEVICE)
    dist.all_to_all_single(recv, torch.arange(float(size), device=DEVICE) + 100 * rank)
    got["all_to_all_single"] = recv.tolist() == [float(100 * r + rank) for r in range(size)]
    if DEVICE == "cpu":   # NCCL has no gather or scatter of its own (torch builds them of sends)
        gathered = [torch.empty(5) for _ in range(size)] if rank == 0 else None
        dist.gather(_value(rank), gathered, dst=0)
        got["gather"] = rank != 0 or all(torch.equal(g, e) for g, e in zip(gathered, every))
        piece = torch.empty(5)
        dist.scatter(piece, every if rank == size - 1 else None, src=size - 1)
        got["scatter"] = torch.equal(piece, every[rank])
    r = _value(rank)
    dist.reduce(r, dst=size - 1)
    got["reduce"] = torch.allclose(r, sum(every)) if rank == size - 1 else True
    return {k: v for k, v in got.items() if v is not True}


def collectives() -> None:
    """Every rank checks the collectives on device tensors on the default group (the elastic
    group) and prints one line: "collectives ok rank R size N on DEVICE" or what was wrong."""
    import elastic

    @elastic.run
    def check(_state):
        rank, size = elastic.rank(), elastic.size()
        wrong = collectives_checked(rank, size)
        print(f"collectives {'ok' if not wrong else 'WRONG ' + repr(wrong)} rank {rank} size {size} on {DEVICE}",
              flush=True)

    check(elastic.ObjectState())


def torch_ddp() -> None:
    """The same loop on torch's own group under torchrun: NCCL on a GPU, gloo on the CPU."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    model = build()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if DEVICE == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(STEPS):
        # Printed with the rank as elastic-run prefixes a worker's lines ("[tr-0] step ..."):
        # torchrun passes its workers' output through as it is.
        if one_step(ddp, opt, step, rank, size, prefix=f"[tr-{rank}] "):
            break
        time.sleep(SLEEP)
    print(f"[tr-{rank}] " + state_line(model, opt, STEPS), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    {"ddp": elastic_ddp, "collectives": collectives, "torch-ddp": torch_ddp}[MODE]()
