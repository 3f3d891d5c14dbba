"""A worker that does, under elastic-run, one thing a torchrun script does (argv[1] names it),
or uses the default group after the run (``after-run``)."""

import sys

mode = sys.argv[1]
if mode == "rank-before-run":
    import elastic  # noqa: F401  (first, as isort puts a third-party "elastic" before "torch")
    import torch.distributed as dist
    print(dist.get_rank())
    sys.exit(0)

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import elastic

net = torch.nn.Linear(4, 2)
state = elastic.TorchState(model=net)
if mode == "torch-ddp-before-run":
    DDP(net)
if mode == "init-before-run":
    dist.init_process_group("gloo")
if mode == "sampler-before-run":
    torch.utils.data.DistributedSampler(list(range(10)))


@elastic.run
def train(state):
    if mode == "torch-ddp-inside-run":
        DDP(net)
    if mode == "init-inside-run":
        dist.init_process_group("gloo")
    if mode == "dcp-inside-run":
        import torch.distributed.checkpoint as dcp
        dcp.save({"net": net.state_dict()}, checkpoint_id=sys.argv[2])
    t = torch.ones(1)
    dist.all_reduce(t)
    state.commit()


train(state)
if mode == "after-run":
    t = torch.full((1,), float(dist.get_rank() + 1))
    dist.all_reduce(t)   # on the last world's ring, as torchrun scripts sum final metrics
    dist.barrier()
    print(f"after the run: rank {dist.get_rank()} of {dist.get_world_size()} summed {t.item():g}", flush=True)
    dist.destroy_process_group()
    try:
        dist.barrier()
    except ValueError as e:
        print(f"after destroy_process_group: {e}", flush=True)
