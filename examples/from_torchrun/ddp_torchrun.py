"""A torch DDP training script in two versions that differ only where elastic-ring needs it:
ddp_torchrun.py as torchrun runs it, ddp_elastic.py on elastic-ring (docs: "From torchrun: DDP").

    torchrun --standalone --nproc-per-node 2 examples/from_torchrun/ddp_torchrun.py
    elastic-run --np 2 -- python examples/from_torchrun/ddp_elastic.py
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 20, generator=gen)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


def train(model, loader, sampler, opt, epochs):
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {total[0] / total[1]:.4f} over {int(total[1])} samples, "
                  f"{len(loader)} batches per rank", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--save", default="model.pt")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    model = DDP(net)
    dataset = make_dataset(2048)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    train(model, loader, sampler, opt, args.epochs)

    if dist.get_rank() == 0:
        torch.save(net.state_dict(), args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
