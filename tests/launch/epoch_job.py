"""A torchrun-style epoch loop on ElasticSampler and a DataLoader, for the launcher tests.

Each epoch: set_epoch, the batches (an allreduce each, record_batch), a per-epoch line on every
rank ("epoch E: S samples in all, len(loader) B, on N worker(s)"), then the end-of-epoch commit.
Knobs (environment): EJ_EPOCHS (3); EJ_PAUSE=EPOCH:SECONDS rank 0 works alone for SECONDS after
that epoch's end-of-epoch commit, once per process (an evaluation, a checkpoint); EJ_LOADER_WORKERS
the DataLoader's num_workers (0). It does not configure logging: what it logs is the runtime's doing.
"""

import os
import time

import torch

import elastic

torch.set_num_threads(1)
EPOCHS = int(os.environ.get("EJ_EPOCHS", "3"))
PAUSE = [float(x) for x in os.environ["EJ_PAUSE"].split(":")] if os.environ.get("EJ_PAUSE") else None
paused = False

dataset = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32))
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler,
                                     num_workers=int(os.environ.get("EJ_LOADER_WORKERS", "0")))
state = elastic.TorchState(sampler=sampler, epoch=0, batch=0)


@elastic.run
def train(state):
    global paused
    for state.epoch in range(state.epoch, EPOCHS):
        sampler.set_epoch(state.epoch)
        seen = torch.zeros(1)
        for state.batch, (x,) in enumerate(loader):
            seen += elastic.allreduce(torch.tensor([float(len(x))]), elastic.Sum)
            sampler.record_batch(state.batch, len(x))
            if state.batch % 100 == 0:
                state.commit()
        print(f"epoch {state.epoch}: {int(seen.item())} samples in all, len(loader) {len(loader)}, "
              f"on {elastic.size()} worker(s)", flush=True)
        state.commit()
        if PAUSE and not paused and elastic.rank() == 0 and state.epoch == PAUSE[0]:
            paused = True
            time.sleep(PAUSE[1])   # rank 0 is busy, not hung


train(state)
