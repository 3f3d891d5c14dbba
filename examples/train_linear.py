"""Linear regression on synthetic data: the smallest complete elastic-ring training script.

    elastic-run --np 4 -- python examples/train_linear.py
    elastic-run --np 4 -- python examples/train_linear.py --epochs 40 --step-sleep 0.05   # time to kill one
    sbatch examples/slurm/train.sbatch        # on a Slurm cluster, with --checkpoint-dir to survive a requeue

The data come from known weights (w_i = i/16, bias 0.5, a little noise), so the script ends by
printing how far the learned weights are from them. Rank 0 prints the loss of every epoch,
and a line whenever training (re)starts in a new world (a worker died or joined).
"""

import argparse
import logging
import time

import torch

import elastic

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=15)
p.add_argument("--samples", type=int, default=2048)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--lr", type=float, default=0.05, help="learning rate for one worker; scaled by size()")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slows it for demos)")
p.add_argument("--checkpoint-dir", help="durable commits there (rank 0 writes every 10th): a job started again "
                                        "after losing every worker (a requeue) resumes from the last one")
args = p.parse_args()

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
torch.manual_seed(0)
torch.set_num_threads(1)

# The same synthetic data on every worker: generated from a fixed seed, no download.
features = 16
true_w = torch.arange(features, dtype=torch.float32) / features
true_b = 0.5
gen = torch.Generator().manual_seed(1)
X = torch.randn(args.samples, features, generator=gen)
Y = X @ true_w + true_b + 0.01 * torch.randn(args.samples, generator=gen)
dataset = torch.utils.data.TensorDataset(X, Y.unsqueeze(1))

model = torch.nn.Linear(features, 1)
opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)


def scale_lr():
    # The gradient is averaged over size() workers, so each step sees size() times the data:
    # scale the learning rate with the world (capped, for stability).
    for group in opt.param_groups:
        group["lr"] = args.lr * min(elastic.size(), 4)


state.register_reset_callbacks([scale_lr])  # after every world change


@elastic.run(checkpoint_dir=args.checkpoint_dir)
def train(state):
    # Called again after every world change, with the state synced from the most advanced worker.
    scale_lr()
    if elastic.rank() == 0:
        print(f"world version {elastic.world_version()}: training on {elastic.size()} worker(s) from epoch "
              f"{state.epoch}, batch {state.batch}", flush=True)
    for state.epoch in range(state.epoch, args.epochs):
        sampler.set_epoch(state.epoch)
        total, count = torch.zeros(2), 0
        for state.batch, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            sampler.record_batch(state.batch, len(x))
            total += torch.tensor([loss.item() * len(x), len(x)])
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if state.batch % 5 == 0:
                state.commit()
        # Mean loss of this epoch's batches over all workers (those since the last world change).
        total = elastic.allreduce(total, elastic.Sum)
        if elastic.rank() == 0:
            print(f"epoch {state.epoch}: loss {total[0] / max(total[1], 1):.6f} on {elastic.size()} worker(s)",
                  flush=True)
        state.commit()


t0 = time.monotonic()
train(state)
error = max((model.weight.detach().view(-1) - true_w).abs().max().item(), abs(model.bias.item() - true_b))
print(f"done in {time.monotonic() - t0:.1f} s: max |w - w_true| = {error:.4f}", flush=True)
