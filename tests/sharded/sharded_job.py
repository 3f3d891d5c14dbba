"""A sharded (FSDP2) training job for the ShardedState tests; run as a worker with ELASTIC_* set.

Knobs (environment):
  JOB_OUT          directory for progress-<worker>.txt and events-<worker>.jsonl
  JOB_STEPS        optimizer steps (default 30); JOB_COMMIT_EVERY commit every N steps (default 2)
  JOB_STEP_SLEEP   seconds per step (default 0)
  JOB_WIDE         1: width 64 and vocabulary 256, which 2 and 4 ranks divide (for the memory bound)
  JOB_KILL         "WORKER:STEP[:SIZE][,...]": that worker SIGKILLs itself inside backward at the first
                   step >= STEP taken in a world of SIZE workers that shrank to that size (this
                   worker was in a larger one before), or without SIZE in a world of
                   JOB_KILL_SIZE workers or more (default: any size)
  JOB_GO_FILE      wait (up to 120 s) for this file before joining: the worker is started early, so
                   its imports are done by the time the test lets it join
  JOB_UNTIL_SIZE   N: after JOB_STEPS, go on until 5 steps in a row ran in a world of N or more
  JOB_META         1: build() makes the model on the meta device (values come from the commit)
  JOB_STOP_FILE    after JOB_STEPS, go on until this file exists (decided collectively each step)
  JOB_CHECKPOINT   a directory: durable commits there, every JOB_DURABLE_EVERY-th commit (default 2)
  JOB_EVIL         "WORKER:MODE": that worker is a hostile member from its second world on (WORKER
                   "any": whichever worker acts first, once in the job). MODE "claim": it announces a
                   complete one-rank commit at step 10^9 of the world it was in with the others (so it
                   would be the reshard's root); "claim-now": the same, of the world forming now;
                   "buffer": as the root of a reshard it sends the replicated state with a buffer of
                   the wrong shape; "bytes": every shift of a reshard's rows it takes part in carries
                   64 bytes more than planned

The model is a tiny transformer-like stack whose width (10) and vocabulary (37) no world size
here divides. The batch of a step is a function of (step, rank). Every commit and every world's
first step append a JSON line with the SHA-256 of the gathered full model and optimizer state;
a world's line also says whether every rank's buddy copy is bitwise its previous rank's own copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import torch
from torch.distributed.fsdp import fully_shard

import elastic

OUT = os.environ["JOB_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
STEPS = int(os.environ.get("JOB_STEPS", "30"))
COMMIT_EVERY = int(os.environ.get("JOB_COMMIT_EVERY", "2"))
STEP_SLEEP = float(os.environ.get("JOB_STEP_SLEEP", "0"))
KILL_SIZE = int(os.environ.get("JOB_KILL_SIZE", "0"))
KILL = {w: (int(s), int(n[0]) if n else None)
        for w, s, *n in (k.split(":") for k in os.environ.get("JOB_KILL", "").split(",") if k)}
GO_FILE = os.environ.get("JOB_GO_FILE", "")
UNTIL_SIZE = int(os.environ.get("JOB_UNTIL_SIZE", "0"))
META = os.environ.get("JOB_META") == "1"
STOP_FILE = os.environ.get("JOB_STOP_FILE", "")
CHECKPOINT = os.environ.get("JOB_CHECKPOINT") or None
DURABLE_EVERY = int(os.environ.get("JOB_DURABLE_EVERY", "2"))
EVIL = os.environ.get("JOB_EVIL", ":").split(":") + [""]
DIM, VOCAB = (64, 256) if os.environ.get("JOB_WIDE") == "1" else (10, 37)
torch.set_num_threads(1)   # four workers share two cores


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 3 * DIM)
        self.down = torch.nn.Linear(3 * DIM, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.register_buffer("scale", torch.full((DIM,), 0.5))

    def forward(self, tokens):
        h = self.embed(tokens) * self.scale
        for i, block in enumerate(self.layers):
            h = block(h)
            if i == 0 and WORKER in KILL and _kill_now(*KILL[WORKER]):
                h.register_hook(_die)   # runs mid-backward, after the head's gradients are reduced
        return self.head(h)


_largest = 0   # the largest world this worker trained in


def _kill_now(step, size):
    global _largest
    now, _largest = elastic.size(), max(_largest, elastic.size())
    return STATE.step >= step and (now == size < _largest if size is not None else now >= KILL_SIZE)


def _die(grad):
    os.kill(os.getpid(), signal.SIGKILL)


def build():
    if META:
        with torch.device("meta"):
            return Tiny()
    torch.manual_seed(0)
    return Tiny()


def shard(model, mesh):
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


evil_acts = []   # (mode, world version) of each hostile act of this worker


def may_act():
    """Whether this worker may act now: always when it is the named one; with "any", only the
    first worker of the job to ask (a file made exclusively) and then only it."""
    if EVIL[0] != "any" or evil_acts:
        return True
    try:
        os.close(os.open(os.path.join(OUT, "evil-acted"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def acted(mode, version):
    evil_acts.append((mode, version))
    event("evil", mode=mode, v=version)


def stubborn(method):
    """``method`` of the state, except that once this worker has acted, any error in it (refused
    by the others, or the ring they broke off) leaves it alive in the job, never leaving: only an
    eviction removes it."""
    def call(*args, **kw):
        try:
            return method(*args, **kw)
        except Exception as e:
            if not evil_acts:
                raise
            event("refused", message=f"{type(e).__name__}: {e}")
            threading.Event().wait()
    return call


def turn_evil(mode):
    """This worker's hostile part (JOB_EVIL), armed once it has been in a world with the others."""
    from elastic.ring.communicator import Communicator
    from elastic.sharded import reshard, transfer
    first = []   # the first world's version: the member is honest in it

    def armed(version):
        first[:] = first or [version]
        return version != first[0]
    if mode in ("claim", "claim-now"):
        real_agree = transfer.agree_holdings

        def claim(comm, held, pending):
            if held is not None and may_act():
                version = comm.world_version if mode == "claim-now" else held[0].world_version
                held, pending = (reshard.Generation(10 ** 9, version, 1), 0), None
                acted(mode, comm.world_version)
            return real_agree(comm, held, pending)
        transfer.agree_holdings = claim
    elif mode == "buffer":
        real_broadcast = Communicator.broadcast_object

        def broadcast(self, obj, root_rank=0, op="broadcast_object", **kw):
            if armed(self.world_version) and obj is not None and op == "ShardedState sync" and may_act():
                obj = {**obj, "buffers": {**obj["buffers"], "scale": torch.zeros(3)}}
                acted(mode, self.world_version)
            return real_broadcast(self, obj, root_rank=root_rank, op=op, **kw)
        Communicator.broadcast_object = broadcast
    elif mode == "bytes":
        real_shift = Communicator.shift_into_

        def shift(self, input, output, *, backward=False):
            if armed(self.world_version) and may_act():
                input = torch.cat([input, torch.zeros(64, dtype=input.dtype)])
                acted(mode, self.world_version)
            return real_shift(self, input, output, backward=backward)
        Communicator.shift_into_ = shift


if EVIL[1] and EVIL[0] in (WORKER, "any"):
    turn_evil(EVIL[1])


STATE = elastic.ShardedState(build, shard, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
                             step=0, tail=0)
if EVIL[1] and EVIL[0] in (WORKER, "any"):
    for name in ("_reshard", "_take_copies"):
        object.__setattr__(STATE, name, stubborn(getattr(STATE, name)))


def event(kind, **fields):
    with open(os.path.join(OUT, f"events-{WORKER}.jsonl"), "a") as f:
        f.write(json.dumps({"ev": kind, "t": time.time(), **fields}) + "\n")


def progress():
    tmp = os.path.join(OUT, f".progress-{WORKER}")
    with open(tmp, "w") as f:
        f.write(f"{STATE.step} {elastic.size()} {elastic.world_version()}")
    os.replace(tmp, os.path.join(OUT, f"progress-{WORKER}.txt"))


def digest():
    """SHA-256 of the full model and optimizer state, gathered (a collective)."""
    h = hashlib.sha256()
    full = STATE.full_state_dict()
    for k in sorted(full):
        h.update(k.encode())
        h.update(full[k].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for k, states in sorted(STATE.full_optimizer_state().items()):
        for name, v in sorted(states.items()):
            h.update(f"{k}.{name}".encode())
            h.update(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if isinstance(v, torch.Tensor) else
                     repr(v).encode())
    return h.hexdigest()


def copies_agree():
    """Whether every rank's buddy copy of the last commit is bitwise the previous rank's own copy
    (a collective; None in a world of one, which has no buddy)."""
    if elastic.size() == 1:
        return None
    sha = [hashlib.sha256(STATE._own["flat"].numpy().tobytes()).digest(),
           hashlib.sha256(STATE._buddy["flat"].numpy().tobytes()).digest()]
    every = elastic.allgather(torch.frombuffer(bytearray(b"".join(sha)), dtype=torch.uint8).view(1, 64))
    n = every.shape[0]
    return all(bytes(every[r, 32:].tolist()) == bytes(every[(r - 1) % n, :32].tolist()) for r in range(n))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
    return tokens, torch.roll(tokens, 1, dims=1)


def stop_requested():
    flag = torch.tensor([1 if os.path.exists(STOP_FILE) else 0], dtype=torch.int32)
    return bool(elastic.allreduce(flag, elastic.Max).item())


@elastic.run(checkpoint_dir=CHECKPOINT, checkpoint_every=DURABLE_EVERY)
def train(state):
    event("world", step=state.step, commit=state.commit_step, v=elastic.world_version(), size=elastic.size(),
          rank=elastic.rank(), digest=digest(), memory=state.memory_bytes(), copies=copies_agree(),
          moved=state.last_reshard["moved_bytes"] if state.last_reshard else 0,
          buddy_bytes=state.last_reshard["buddy_bytes"] if state.last_reshard else 0)
    model, opt = state.model, state.optimizer
    while state.step < STEPS or (UNTIL_SIZE and state.tail < 5) or (STOP_FILE and not stop_requested()):
        tokens, target = batch(state.step, elastic.rank())
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        state.step += 1
        if state.step > STEPS and UNTIL_SIZE:
            state.tail = state.tail + 1 if elastic.size() >= UNTIL_SIZE else 0
        progress()
        event("step", step=state.step, v=elastic.world_version(), size=elastic.size(), rank=elastic.rank())
        time.sleep(STEP_SLEEP)
        if state.step % COMMIT_EVERY == 0:
            # The live state is what the commit copies: its digest is the commit's, whether the
            # commit then completes, ends in a change of world, or is cut short.
            event("commit", step=state.step, commit=state.commit_step + 1, v=elastic.world_version(),
                  size=elastic.size(), digest=digest(), memory=state.memory_bytes())
            state.commit()
    state.commit()
    return state.step


if __name__ == "__main__":
    if GO_FILE:
        from tests.waiting import wait_until
        wait_until(lambda: os.path.exists(GO_FILE), 120, f"the go file {GO_FILE}", interval=0.05)
    steps = train(STATE)
    full = STATE.full_state_dict()
    event("done", step=steps, params=sum(t.numel() for t in full.values()))
