"""One rank of bench/fsdp.py: the same FSDP2 training step under torchrun (gloo) or elastic-run (the ring).

    torchrun --standalone --nproc-per-node 2 bench/_fsdp_worker.py --mode gloo
    elastic-run --np 2 -- python bench/_fsdp_worker.py --mode elastic
    ELASTIC_DEFAULT_GROUP=0 elastic-run --np 2 -- python bench/_fsdp_worker.py --mode paired

Both modes build the same small decoder-only transformer (~70M parameters with the defaults)
from the same seed, shard every block and the root with ``fully_shard`` (FSDP2's defaults:
float32, parameters resharded after forward) and step AdamW on the same per-rank batch of
token ids: ``--mode gloo`` on a 1-D mesh over the gloo group torchrun's environment describes,
``--mode elastic`` inside ``elastic.run`` on ``elastic.device_mesh()`` (ELASTIC_TRANSPORT picks
shared memory or TCP). After ``--warmup`` steps it times ``--rounds`` rounds of ``--steps``
steps, each between two barriers, and keeps, per round, the time spent inside FSDP2's
all-gathers and reduce-scatters (``dist.all_gather_single``/``reduce_scatter_single``, where
FSDP2 calls them, timed the same way for both groups). Then ``--micro`` times the raw
collectives on one block's flat parameters: all_gather_into_tensor and reduce_scatter_tensor,
median of 5. Rank 0 prints one line ``BENCH_RESULT {json}``.

``--mode paired`` trains both in the same processes under elastic-run, one model over a gloo
group (torch's default group, over a TCPStore rank 0 hosts) and one over the elastic mesh,
their timed rounds alternating (gloo first in even rounds, elastic first in odd ones), so that
load from elsewhere falls on both alike; its result line has one entry per group.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


HEAD_DIM = 64


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1), persistent=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask[: ids.shape[1], : ids.shape[1]])
        return self.head(self.norm(x))


def build(args) -> Transformer:
    torch.manual_seed(0)
    return Transformer(args.vocab, args.dim, args.layers, args.dim // HEAD_DIM, args.seq)


def shard(model: Transformer, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class CommClock:
    """Seconds spent inside FSDP2's all-gathers and reduce-scatters (it calls them through
    ``torch.distributed``'s module attributes, so wrapping those sees every call, for any group)."""

    def __init__(self) -> None:
        self.seconds = {"all_gather": 0.0, "reduce_scatter": 0.0}
        for name, key in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter")):
            real = getattr(dist, name)

            def timed(*a, _real=real, _key=key, **kw):
                t0 = time.perf_counter()
                try:
                    return _real(*a, **kw)
                finally:
                    self.seconds[_key] += time.perf_counter() - t0
            setattr(dist, name, timed)

    def take(self) -> dict:
        out = dict(self.seconds)
        for k in self.seconds:
            self.seconds[k] = 0.0
        return out


class Trainer:
    """One FSDP2 model, its optimizer and its group: warm-up, and timed rounds of steps."""

    def __init__(self, args, mesh, clock: CommClock):
        self.args, self.clock, self.group = args, clock, mesh.get_group()
        self.model = build(args)
        self.params = sum(q.numel() for q in self.model.parameters())
        shard(self.model, mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(self.group.rank())
        self.ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        for _ in range(args.warmup):
            self.step()

    def step(self) -> None:
        logits = self.model(self.ids[:, :-1])
        self.loss_fn(logits.reshape(-1, self.args.vocab), self.ids[:, 1:].reshape(-1)).backward()
        self.opt.step()
        self.opt.zero_grad()

    def round(self) -> dict:
        """Steps/s of one round, and the seconds per step inside all-gathers and reduce-scatters."""
        steps = self.args.steps
        dist.barrier(group=self.group)
        self.clock.take()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        dist.barrier(group=self.group)
        took = time.perf_counter() - t0
        comm = self.clock.take()
        return {"steps_per_s": steps / took, "step_s": took / steps, **{f"{k}_s": v / steps for k, v in comm.items()}}

    def result(self, rounds: list) -> dict:
        return {"rounds": rounds, "micro": micro(self.model, self.group, self.group.size())}


def micro(model: Transformer, group, size: int) -> dict:
    """The raw collectives on one block's parameters (what FSDP2 moves per block): median ms of 5."""
    per_rank = -(-sum(p.numel() for p in model.blocks[0].parameters()) // size)   # DTensor numel: the full one
    shard = torch.randn(per_rank)
    full = torch.empty(per_rank * size)
    out = {}
    for name, call in (("all_gather_into_tensor", lambda: dist.all_gather_single(full, shard, group=group)),
                       ("reduce_scatter_tensor", lambda: dist.reduce_scatter_single(shard, full, group=group))):
        call()
        times = []
        for _ in range(5):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    out["bytes"] = per_rank * size * 4
    return out


def report(mode: str, size: int, rank: int, params: int, results: dict, links) -> None:
    """``results``: per group ("gloo", "elastic") its rounds and micro-benchmark."""
    if rank == 0:
        print("BENCH_RESULT " + json.dumps({"mode": mode, "size": size, "params": params, "results": results,
                                            "links": links}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("gloo", "elastic", "paired"), required=True,
                   help="gloo: FSDP2 on gloo (start with torchrun); elastic: FSDP2 on elastic.device_mesh() "
                        "(start with elastic-run); paired: both in the same processes, rounds alternating "
                        "(start with ELASTIC_DEFAULT_GROUP=0 elastic-run)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds (default 2)")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dim", type=int, default=640, help="model width, a multiple of 64 (default 640)")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    args = p.parse_args()
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be at least 1, --warmup at least 0")
    if args.dim < HEAD_DIM or args.dim % HEAD_DIM:
        p.error(f"--dim must be a multiple of {HEAD_DIM} (the attention heads' width)")
    torch.set_num_threads(1)
    clock = CommClock()
    from torch.distributed.device_mesh import init_device_mesh

    if args.mode == "gloo":
        dist.init_process_group("gloo")   # torchrun's env://: MASTER_ADDR, RANK, WORLD_SIZE …
        t = Trainer(args, init_device_mesh("cpu", (dist.get_world_size(),)), clock)
        rounds = [t.round() for _ in range(args.rounds)]
        report("gloo", dist.get_world_size(), dist.get_rank(), t.params, {"gloo": t.result(rounds)}, None)
        dist.destroy_process_group()
        return

    import elastic

    @elastic.run
    def train(state):
        rank, size = elastic.rank(), elastic.size()
        trainers = {}
        if args.mode == "paired":
            # gloo as torch's default group, over a store rank 0 hosts (its port goes round the ring).
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False) if rank == 0 else None
            port = elastic.broadcast_object(store.port if store is not None else None, root_rank=0)
            if store is None:
                store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
            trainers["gloo"] = Trainer(args, init_device_mesh("cpu", (size,)), clock)
        trainers["elastic"] = Trainer(args, elastic.device_mesh(), clock)
        rounds = {k: [] for k in trainers}
        for i in range(args.rounds):
            for k in (list(trainers) if i % 2 == 0 else list(trainers)[::-1]):
                rounds[k].append(trainers[k].round())
        results = {k: t.result(rounds[k]) for k, t in trainers.items()}
        report(args.mode, size, rank, trainers["elastic"].params, results, list(elastic.runtime.world.ring().link_kinds))
        if args.mode == "paired":
            dist.destroy_process_group()

    train(elastic.ObjectState())


if __name__ == "__main__":
    main()
