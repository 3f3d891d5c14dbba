"""A torchrun FSDP2 training script (a small transformer, fully_shard per block, AdamW,
DistributedSampler, DCP saves), and fsdp_elastic.py, the same on elastic-ring (docs: "From
torchrun: FSDP2").

    torchrun --standalone --nproc-per-node 2 examples/from_torchrun/fsdp_torchrun.py
"""
import argparse

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, WIDTH, BLOCKS, SEQ = 256, 64, 3, 16


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
            for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.flatten(0, 1))   # (batch * sequence, vocabulary)


def make_dataset(n):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return TensorDataset(x[:, :-1], x[:, 1:])


def shard(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train(model, loader, sampler, opt, epochs, ckpt):
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for i, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y.flatten())
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {total[0] / total[1]:.4f} over {int(total[1])} samples, "
                  f"{len(loader)} batches per rank", flush=True)
        dcp.save(get_model_state_dict(model), checkpoint_id=f"{ckpt}/epoch-{epoch}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ckpt", default="ckpt")
    args = p.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Model()
    shard(model, mesh)
    dataset = make_dataset(512)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    train(model, loader, sampler, opt, args.epochs, args.ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
