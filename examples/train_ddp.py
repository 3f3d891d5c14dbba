"""A plain torch DDP training script on elastic-ring, with a commit every few batches.

    elastic-run --np 4 -- python examples/train_ddp.py
    elastic-run --np 4 -- python examples/train_ddp.py --epochs 30 --step-sleep 0.05   # time to kill one

The lines marked ``# elastic`` wrap the model, name the state to keep, and run the loop
under ``elastic.run``: a failed worker costs the others a restore of the last
``state.commit()``, nothing more. Everything else (``dist.get_rank()``, ``dist.all_reduce``,
the DDP forward/backward, the optimizer) is torch's own, on the elastic ring.
examples/from_torchrun/ shows a torchrun script next to its elastic-ring version.
"""

import argparse
import time

import torch
import torch.distributed as dist

import elastic

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=10)
p.add_argument("--samples", type=int, default=4096)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--commit-every", type=int, default=10, help="commit every N batches")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slows it for demos)")
args = p.parse_args()

torch.manual_seed(0)
torch.set_num_threads(1)


class ToyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = torch.nn.Linear(10, 64)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(64, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


# Synthetic data, the same on every worker (a fixed seed, no download).
gen = torch.Generator().manual_seed(1)
X = torch.randn(args.samples, 10, generator=gen)
Y = torch.tanh(X[:, :5]) + 0.05 * torch.randn(args.samples, 5, generator=gen)
dataset = torch.utils.data.TensorDataset(X, Y)

net = ToyModel()
model = elastic.DistributedDataParallel(net)                                        # elastic
loss_fn = torch.nn.MSELoss()
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
state = elastic.TorchState(model=net, optimizer=opt, sampler=sampler, epoch=0)     # elastic


@elastic.run                                                                        # elastic
def train(state):
    if dist.get_rank() == 0:
        print(f"world version {elastic.world_version()}: {dist.get_world_size()} worker(s) from epoch "
              f"{state.epoch}", flush=True)
    for state.epoch in range(state.epoch, args.epochs):
        sampler.set_epoch(state.epoch)
        total = torch.zeros(2)
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()                   # DDP's bucketed allreduce, on the ring
            opt.step()
            sampler.record_batch(i, len(x))
            total += torch.tensor([loss.item() * len(x), len(x)])
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if i % args.commit_every == 0:
                state.commit()
        dist.all_reduce(total)                # torch.distributed's default group is the ring
        if dist.get_rank() == 0:
            print(f"epoch {state.epoch}: loss {total[0] / total[1]:.5f} over {int(total[1])} samples", flush=True)
        state.commit()


train(state)
if dist.get_rank() == 0:
    print(f"done in world version {elastic.world_version()}", flush=True)
