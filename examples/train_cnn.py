"""A small CNN on synthetic images, with ElasticSampler and DistributedOptimizer.

    elastic-run --np 4 -- python examples/train_cnn.py
    elastic-run --np 4 --min-np 2 -- python examples/train_cnn.py --epochs 20 --step-sleep 0.05

Each 1x16x16 image is noise plus a bright 6x6 square in one of four quadrants; the class is
the quadrant. The data are generated from a fixed seed on every worker (no download), so
any worker can serve any shard. Rank 0 prints loss and accuracy per epoch, and a line
whenever training (re)starts in a new world. The learning rate follows the world size.
"""

import argparse
import logging
import time

import torch
import torch.nn.functional as F

import elastic

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--samples", type=int, default=2048)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--lr", type=float, default=0.02, help="learning rate for one worker; scaled by size()")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slows it for demos)")
args = p.parse_args()

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
torch.manual_seed(0)
torch.set_num_threads(1)


def synthetic_images(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=gen)
    images = torch.randn(n, 1, 16, 16, generator=gen)
    for i, c in enumerate(labels.tolist()):
        r, col = (c // 2) * 8 + 1, (c % 2) * 8 + 1
        images[i, 0, r:r + 6, col:col + 6] += 0.6
    return torch.utils.data.TensorDataset(images, labels)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16 * 4 * 4, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


dataset = synthetic_images(args.samples, seed=1)
model = Net()
opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)


def scale_lr():
    for group in opt.param_groups:
        group["lr"] = args.lr * elastic.size()


state.register_reset_callbacks([scale_lr])  # after every world change


@elastic.run
def train(state):
    # Called again after every world change, with the state synced from the most advanced worker.
    scale_lr()
    if elastic.rank() == 0:
        print(f"world version {elastic.world_version()}: training on {elastic.size()} worker(s) from epoch "
              f"{state.epoch}, batch {state.batch}", flush=True)
    for state.epoch in range(state.epoch, args.epochs):
        sampler.set_epoch(state.epoch)
        stats = torch.zeros(3)  # loss sum, correct, samples
        for state.batch, (x, y) in enumerate(loader):
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            sampler.record_batch(state.batch, len(x))
            stats += torch.tensor([loss.item() * len(x), (out.argmax(1) == y).sum().item(), len(x)])
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if state.batch % 5 == 0:
                state.commit()
        stats = elastic.allreduce(stats, elastic.Sum)
        if elastic.rank() == 0:
            n = max(stats[2].item(), 1)
            print(f"epoch {state.epoch}: loss {stats[0] / n:.4f}, accuracy {stats[1] / n:.3f} "
                  f"on {elastic.size()} worker(s)", flush=True)
        state.commit()


t0 = time.monotonic()
train(state)
with torch.no_grad():
    test = synthetic_images(512, seed=2)
    accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
print(f"done in {time.monotonic() - t0:.1f} s: accuracy on fresh images {accuracy:.3f}", flush=True)
