"""A worker for the installed-package test: three committed SGD steps under elastic.run, then one line.

Copied outside the checkout and run by the installed `elastic-run`. Rank r feeds rows of r + 1, so
the averaged gradient moves every weight by lr * mean(2 * (r + 1)) per step, which only a real
allreduce over every rank gives. It prints one JSON line: rank, size, how far each weight moved,
the weights themselves, and where elastic, its native core and rendezvous were imported from.
"""

import json

import torch

import elastic
import rendezvous

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Linear(4, 1)
start = model.weight.detach().clone().view(-1)
opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
state = elastic.TorchState(model=model, optimizer=opt, step=0)


@elastic.run
def train(state):
    for state.step in range(state.step, 3):
        opt.zero_grad()
        model(torch.full((2, 4), float(elastic.rank() + 1))).sum().backward()
        opt.step()
        state.commit()


train(state)
weights = model.weight.detach().view(-1)
print(json.dumps({"rank": elastic.rank(), "size": elastic.size(), "moved": (start - weights).tolist(),
                  "weights": weights.tolist(), "elastic": elastic.__file__,
                  "native": elastic.ring._native.__file__, "rendezvous": rendezvous.__file__}), flush=True)
