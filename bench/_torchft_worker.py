"""One replica group of bench/goodput.py's TorchFT run: the goodput job under torchft's Manager and DDP.

    python bench/_torchft_worker.py --run-dir DIR --group G --groups W --lighthouse http://HOST:PORT \
        --settings example|defaults

Started (and, after a SIGKILL, started again) by bench/_torchft_launch.py, one process per
replica group, as TorchFT's documentation expects a scheduler to do. The model, optimizer and
per-step batch size are bench/_goodput_worker.py's. Each process is a whole replica group of one
rank: it holds the group's TCPStore, and its torchft.Manager (group rank 0) runs the group's
ManagerServer against the lighthouse. Everything else is TorchFT's documented path:
torchft.ProcessGroupGloo, torchft.DistributedDataParallel (the gradient allreduce goes through
the manager), asynchronous quorum, live recovery of a rejoining group from a peer. --settings
picks the timeouts and the checkpoint transport (bench/_torchft_settings.py, which names the
source of each): ``example`` as TorchFT's train_ddp.py sets them (gloo 5 s, Manager 30 s, the
state sent over the process group by PGTransport with 10 s), ``defaults`` none (60 s each, the
state sent over HTTP).

The step is what torchft.OptimizerWrapper does (``start_quorum`` before the forward pass,
``optimizer.step()`` only when ``should_commit()`` says so), written out so the outcome can be
logged: TorchFT never goes back, so a committed step is final, and a step it did not commit
has its batch thrown away.

Data: as with torchft.DistributedSampler, group G reads its own shard, samples
G, G+W, G+2W, ...; a batch is the next 32 of them. The shard position advances on every step
tried, committed or not (a batch is consumed when it is read), and is saved after each step
(TorchFT advises checkpointing each group's data loader), so a restarted group resumes where
it stopped instead of repeating its shard. Events, as bench/_goodput_worker.py's plus
"samples" [start, stop, stride] (the sample indices of the batch, ``range(start, stop, stride)``):
  step    a step the group committed and trained its batch in (gen: the quorum id)
  commit  the same step, held (TorchFT commits every step)
  drop    a batch trained in a step that did not count: should_commit() said no (a peer
          failed), or the group was healing (its gradients were not part of the step)
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta

import torch

from _ddp_worker import BATCH, build_model  # bench/ is this script's directory
from _goodput_worker import Events, batch_for, watchdog
from _torchft_settings import SETTINGS


class ShardPosition:
    """The group's position in its shard, in batches; written atomically after every step."""

    def __init__(self, run_dir: str, group: int):
        self.path = os.path.join(run_dir, f"position-{group}")
        self.value = 0
        if os.path.exists(self.path):
            with open(self.path) as f:
                text = f.read(32).strip()
            if not text.isdigit():
                raise ValueError(f"{self.path}: not a batch count: {text!r}")
            self.value = int(text)

    def advance(self) -> None:
        self.value += 1
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(self.value))
        os.replace(tmp, self.path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="directory for the pid files, event logs and shard positions")
    p.add_argument("--group", type=int, required=True, help="this replica group's id, 0..W-1")
    p.add_argument("--groups", type=int, required=True, help="replica groups in the job, W")
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://HOST:PORT")
    p.add_argument("--min-replicas", type=int, default=2, help="torchft's min_replica_size (default 2)")
    p.add_argument("--settings", choices=sorted(SETTINGS), required=True,
                   help="example: the timeouts and checkpoint transport of TorchFT's train_ddp.py; "
                        "defaults: the library's (bench/_torchft_settings.py)")
    args = p.parse_args()
    if not 0 <= args.group < args.groups:
        p.error(f"--group {args.group} is outside 0..{args.groups - 1}")
    torch.set_num_threads(1)
    watchdog()

    import torch.distributed as dist
    import torchft

    events = Events(args.run_dir)
    position = ShardPosition(args.run_dir, args.group)
    # The group's own store: torchft's Manager connects to it as a client.
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    net = build_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def load_state_dict(sd):
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])

    settings = SETTINGS[args.settings]
    # A setting that is None is not passed: the library's default applies, as in a user's code.
    pg = (torchft.ProcessGroupGloo(timeout=timedelta(seconds=settings.pg_timeout_s)) if settings.pg_timeout_s
          else torchft.ProcessGroupGloo())
    chosen = {}
    if settings.manager_timeout_s:
        chosen["timeout"] = timedelta(seconds=settings.manager_timeout_s)
    if settings.transport_timeout_s:
        from torchft.checkpointing.pg_transport import PGTransport

        chosen["checkpoint_transport"] = PGTransport(pg, timeout=timedelta(seconds=settings.transport_timeout_s),
                                                     device=torch.device("cpu"))
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": net.state_dict(), "optimizer": opt.state_dict()},
        min_replica_size=args.min_replicas,
        replica_id=f"group{args.group}",
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, hostname=socket.gethostname(),
        **chosen,
    )
    model = torchft.DistributedDataParallel(manager, net)
    loss_fn = torch.nn.CrossEntropyLoss()
    W = args.groups
    while True:
        start = args.group + W * BATCH * position.value
        samples = (start, start + W * BATCH, W)
        manager.start_quorum()
        opt.zero_grad()
        x, y = batch_for(samples)
        loss_fn(model(x), y).backward()
        participating = manager.is_participating()
        committed = manager.should_commit()
        if committed:
            opt.step()
        # The quorum id is the membership generation: torchft reconfigures its group on a new one
        # (read from the manager's field: no public accessor has it).
        gen = max(0, int(manager._quorum_id))
        size = manager.num_participants()
        step = manager.current_step()
        if committed:
            events.log("step", step, gen, size, samples if participating else None)
            events.log("commit", step, gen, size)
        if not (committed and participating):
            events.log("drop", step + (0 if committed else 1), gen, size, samples)
        # After the log line: a SIGKILL between the two makes the restarted group train this batch
        # again (counted as trained twice), never a batch trained but missing from the log.
        position.advance()


if __name__ == "__main__":
    main()
