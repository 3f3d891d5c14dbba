"""A real training job for the runtime tests; run as a worker process with ELASTIC_* set.

The model carries a buffer that counts, per sample, how often it was trained on (summed
over ranks with an allreduce each step), so the committed/restored/synced state itself
proves the sample accounting. Knobs (environment):
  JOB_OUT        directory for progress-<worker>.txt and result-<worker>.json
  JOB_EPOCHS     epochs (default 3); JOB_SAMPLES dataset size (default 240); JOB_BATCH (8)
  JOB_STEP_SLEEP seconds per step, to leave time for faults (default 0.02)
  JOB_DIE_IN     "commit" or "sync": SIGKILL this very process inside that call, at
                 its own JOB_DIE_AT-th commit (commit) or its JOB_DIE_AT-th sync after a failure
                 (restored or kept; a join's syncs do not count, so how the world first forms does not matter)
  JOB_RAISE_AT   raise a ValueError at this global step on every rank
  JOB_CHECKPOINT durable commits in this directory (every 2nd commit)
  JOB_SLOW_DISK  seconds each durable write takes longer (the writer sleeps, then writes the real file)
  JOB_OPTIMIZER  "sgd" (default: SGD with momentum) or "adamw"
  JOB_EVIL_SYNC  this worker is a hostile sync root: at every sync it claims the highest commit
                 step, and its encode path sends, instead of its state: "size:N" nothing, announced
                 as N bytes; "bytes:PATH" that file's bytes; "state:wrong-shapes" / "state:wrong-keys"
                 its state with the model's weight reshaped / a key added (well-formed, does not fit).
                 When the others refuse it, it stays: alive, in the job, never leaving (only an
                 eviction removes it)
  JOB_EVIL_ROW   this worker is a hostile member of the commits' membership check: "pending" claims
                 a change pending at every commit, "timings" writes 1000 s of compute into its own
                 row, "fast" claims it never computes (to make the others look slow), "leave" says
                 at its JOB_EVIL_AT-th commit (default 3) that it leaves and never does. Evicted,
                 it does not join again: alive, it waits forever (only the test ends it)
  JOB_RETURN_AT  "WORKER:STEP": that worker's training function returns right after its first
                 commit at or past STEP, while the others train on (it leaves the world; they go on)
  JOB_STOP_FILE  end at the first epoch boundary after this file appears (all ranks agree)
  JOB_STOP_BEFORE_FORM  SIGSTOP this process right before it connects its N-th ring (a worker
                 hung while forming; SIGCONT resumes it there, with the world it had then)
  JOB_STALL      "WORKER:STEP:SECONDS": that worker stalls once, at that step (a live but slow peer)
  JOB_LEAVE_AT   "WORKER:STEP": that worker calls elastic.request_leave() once, after that step
  JOB_KILL_AT    "WORKER:WHERE:STEP": that worker SIGKILLs itself in the step that follows STEP
                 completed ones: WHERE is "backward" (while its gradients are being computed and
                 the first buckets are on the ring), "collective" (entering the optimizer's
                 synchronize(), its buckets in flight), "optimizer" (inside the update, after
                 the allreduce completed), "after-step" (right after its update) or "between"
                 (after the step and its record)
  JOB_FORK_CHILD "WORKER:STEP": that worker forks a child once, after its first completed step
                 numbered STEP or later (it may join a world already past STEP), as a
                 DataLoader forks its workers, which sleeps 60 s holding every descriptor it
                 inherited (its pid in a "forked" event)
  JOB_FINAL_BARRIER "WORKER:SECONDS": after the run every worker calls dist.barrier() on the ring
                 kept after it, as a torchrun script ends, but that worker, which sleeps
                 SECONDS instead and exits 0 (a member that skips the final barrier)
  JOB_DIVERGE    "WORKER[,WORKER...]:STEP": those workers, once, at their first step numbered STEP
                 or later, allreduce their per-sample count one element longer than the others
                 (a rank with a data-dependent branch calling another collective)
  JOB_SEEN_AFTER_STEP 1: the per-sample count is allreduced after opt.step() rather than before
                 it (a collective between a step and its sampler record: a failure there cannot
                 keep the live state)

Besides its result, each worker appends JSON lines to events-<worker>.jsonl: every step
(time, step, world version, size), every commit, and every sync (its commit step before and
after, and a digest of its whole state, model, optimizer, sampler and attributes, before and
after), so a test can check that no committed step was lost, that every rank of a world
holds the same bits, and time each recovery.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time

import torch

import elastic
import elastic.ring.serialization
import elastic.state.sync
from digest import bits_digest  # this directory: job.py runs as a script

OUT = os.environ["JOB_OUT"]
WORKER = os.environ["ELASTIC_WORKER_ID"]
EPOCHS = int(os.environ.get("JOB_EPOCHS", "3"))
SAMPLES = int(os.environ.get("JOB_SAMPLES", "240"))
BATCH = int(os.environ.get("JOB_BATCH", "8"))
STEP_SLEEP = float(os.environ.get("JOB_STEP_SLEEP", "0.02"))
DIE_IN = os.environ.get("JOB_DIE_IN", "")
DIE_AT = int(os.environ.get("JOB_DIE_AT", "-1"))
RAISE_AT = int(os.environ.get("JOB_RAISE_AT", "-1"))
CHECKPOINT = os.environ.get("JOB_CHECKPOINT") or None
SLOW_DISK = float(os.environ.get("JOB_SLOW_DISK", "0"))
STOP_FILE = os.environ.get("JOB_STOP_FILE") or None
STOP_BEFORE_FORM = int(os.environ.get("JOB_STOP_BEFORE_FORM", "0"))
OPTIMIZER = os.environ.get("JOB_OPTIMIZER", "sgd")
EVIL_SYNC = os.environ.get("JOB_EVIL_SYNC") or None
LR = 0.1  # with momentum 0.5 the job converges (loss ~1e-5) at every world size it runs at
STALL = os.environ.get("JOB_STALL", "::").split(":")
KILL_AT = os.environ.get("JOB_KILL_AT", "::").split(":")
SEEN_AFTER_STEP = os.environ.get("JOB_SEEN_AFTER_STEP") == "1"
DIVERGE = os.environ.get("JOB_DIVERGE", ":").split(":")
diverged = {"done": False}
LEAVE_AT = os.environ.get("JOB_LEAVE_AT", ":").split(":")
RETURN_AT = os.environ.get("JOB_RETURN_AT", ":").split(":")
FORK_CHILD = os.environ.get("JOB_FORK_CHILD", ":").split(":")
stalled = {"done": False}
forked = {"done": False}

torch.manual_seed(0)
torch.set_num_threads(1)
X = torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(1))
Y = X @ torch.arange(16, dtype=torch.float32).unsqueeze(1) / 16
IDX = torch.arange(SAMPLES)
dataset = torch.utils.data.TensorDataset(X, Y, IDX)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 1)
        self.register_buffer("seen", torch.zeros(SAMPLES, dtype=torch.float64))

    def forward(self, x):
        return self.linear(x)


model = Model()
with torch.no_grad():
    initial_loss = torch.nn.functional.mse_loss(model(X), Y).item()
if OPTIMIZER == "adamw":
    # A tensor lr and per-parameter step tensors: optimizer state that is more than floats.
    base_opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(LR / 10), weight_decay=0.01)
else:
    base_opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
opt = elastic.DistributedOptimizer(base_opt, named_parameters=model.named_parameters())
sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)
state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0, step=0)
log = {"resets": [], "restores": 0, "commits_at_change": []}


def record_reset():
    log["resets"].append({"size": elastic.size(), "version": elastic.world_version(), "commit": state.commit_step})


def rescale_lr():
    # The usual reset callback: the learning rate follows the world size. Its effect must
    # survive the sync that follows it.
    for group in opt.param_groups:
        lr = LR * elastic.size() / 3
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr / 10)
        else:
            group["lr"] = lr


state.register_reset_callbacks([record_reset, rescale_lr])

_restore = state.restore


def counting_restore():
    log["restores"] += 1
    _restore()
    event("restore", commit=state.commit_step, step=state.step)


state.restore = counting_restore
_keep_live = state.keep_live
log["kept"] = 0


def counting_keep_live():
    kept = _keep_live()
    if kept:
        log["kept"] += 1
        event("kept", commit=state.commit_step, step=state.step)
    return kept


state.keep_live = counting_keep_live


def kill_here(where):
    if WORKER == KILL_AT[0] and where == KILL_AT[1] and state.step == int(KILL_AT[2]):
        event("dying", where=where, step=state.step)
        os.kill(os.getpid(), signal.SIGKILL)


if KILL_AT[0]:
    def die_in_backward(grad):
        kill_here("backward")
        return grad

    model.linear.bias.register_hook(die_in_backward)   # computed after the weight's gradient
    _synchronize = opt.synchronize

    def dying_synchronize():
        kill_here("collective")
        _synchronize()

    opt.synchronize = dying_synchronize
    base_opt.register_step_pre_hook(lambda o, a, k: kill_here("optimizer") if o._elastic_synchronized else None)
_sync_over = state.sync_over   # the state's part of every sync the session runs


class Announcing(elastic.ring.serialization.Encoded):
    """Bytes to send as the sync state, announced as ``announced`` bytes long."""

    def __init__(self, payload, announced):
        super().__init__([payload])
        self.nbytes = announced


def evil_encode(step, from_checkpoint):
    kind, _, arg = EVIL_SYNC.partition(":")
    if kind == "size":
        return Announcing(b"", int(arg))
    if kind == "bytes":
        with open(arg, "rb") as f:
            data = f.read()
        return Announcing(data, len(data))
    view = state.live()
    model = dict(view["model"])
    if arg == "wrong-shapes":
        model["linear.weight"] = torch.zeros(4, 4)
    else:
        model["linear.extra"] = torch.zeros(1)
    view["model"] = model
    return elastic.ring.serialization.encode((step, view))


def sync_maybe_dying(comm):
    if EVIL_SYNC:
        # Claims the most advanced commit, so it is the root, and forges what its encode path sends.
        object.__setattr__(state, "commit_step", 10 ** 9)
        state.encode_for_sync = evil_encode
    if DIE_IN == "sync" and log["restores"] + log["kept"] == DIE_AT:
        # Die between the allgather of positions and digests and the broadcast of the state.
        comm.allgather_equal(elastic.state.sync.announcement(state))
        os.kill(os.getpid(), signal.SIGKILL)
    return _sync_over(comm)


def sync_stubbornly(comm):
    try:
        return sync_maybe_dying(comm)
    except elastic.SyncRefusedError as e:
        event("refused", message=str(e))
        threading.Event().wait()   # a hostile member does not leave: its session stays, its pump thread answers


state.sync_over = sync_maybe_dying

EVIL_ROW = os.environ.get("JOB_EVIL_ROW") or None
if EVIL_ROW:
    import elastic.runtime.job_session as job_session
    from elastic.runtime import boundary

    session_class = job_session.JobSession
    evil_at = int(os.environ.get("JOB_EVIL_AT", "3"))
    boundaries = {"n": 0}
    # Evicted, a hostile member stays: alive, never joining again (its watch thread answers probes).
    session_class._rejoin = lambda self, ended: threading.Event().wait()
    if EVIL_ROW == "pending":
        session_class.membership_pending = lambda self: self.comm is not None
    elif EVIL_ROW in ("timings", "fast"):
        _row = boundary.row

        def forged_row(pending, leaving, compute=0.0, wait=0.0, returned=False):
            if EVIL_ROW == "timings":
                return _row(pending, leaving, 1000.0, 0.0, returned)
            return _row(pending, leaving, 0.0, compute + wait, returned)   # waited all along: the others are slow

        boundary.row = forged_row
    elif EVIL_ROW == "leave":
        def says_it_leaves(self):
            boundaries["n"] += 1
            return boundaries["n"] >= evil_at

        session_class.leave_pending = says_it_leaves
        session_class.depart = lambda self: threading.Event().wait()


if STOP_BEFORE_FORM:
    _connect = elastic.ring.communicator.Communicator.connect
    connects = {"n": 0}

    def connect_maybe_stopping(self):
        connects["n"] += 1
        if connects["n"] == STOP_BEFORE_FORM:
            os.kill(os.getpid(), signal.SIGSTOP)
        return _connect(self)

    elastic.ring.communicator.Communicator.connect = connect_maybe_stopping


if SLOW_DISK:
    _write_file = elastic.state.checkpoint.write

    def slow_write(directory, step, snapshot, position=""):
        started = time.time()
        time.sleep(SLOW_DISK)  # a disk this much slower
        path = _write_file(directory, step, snapshot, position)
        event("durable", commit=step, started=started)
        return path

    elastic.state.checkpoint.DurableWriter.write_file = staticmethod(slow_write)


def event(kind, **fields):
    with open(os.path.join(OUT, f"events-{WORKER}.jsonl"), "a") as f:
        f.write(json.dumps({"ev": kind, "t": time.time(), **fields}) + "\n")


# The commit this rank holds and the training step it was taken at: a restore or a sync that
# loads another state under the same commit number shows as a step that does not match.
held = {"commit": -1, "step": 0}


def state_digest():
    """SHA-256 of everything the state holds as a commit or a sync takes it (state.live(): model,
    optimizer, sampler, attributes; a finished epoch as the next), bit for bit (dtypes, shapes,
    bytes, key order)."""
    return bits_digest([state.live(), state.commit_step])


def logged_sync(comm):
    before = dict(held)
    live_step = state.step   # the commit's after a restore; a later one when kept after a failure
    before_digest = state_digest()
    synced = (sync_stubbornly if EVIL_SYNC else sync_maybe_dying)(comm)
    held.update(commit=state.commit_step, step=state.step)
    event("sync", before=before["commit"], before_step=before["step"], before_live=live_step,
          commit=state.commit_step, step=state.step, v=elastic.world_version(), size=elastic.size(),
          before_digest=before_digest, digest=state_digest())
    return synced


state.sync_over = logged_sync


def progress(text):
    tmp = os.path.join(OUT, f".progress-{WORKER}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(OUT, f"progress-{WORKER}.txt"))


commits = {"n": 0}


def commit():
    commits["n"] += 1
    if DIE_IN == "commit" and commits["n"] == DIE_AT:
        state.save()  # the commit's copy is taken; the process dies before it completes
        os.kill(os.getpid(), signal.SIGKILL)
    before = state.commit_step
    try:
        state.commit()
    except elastic.MembershipChanged:
        log["commits_at_change"].append(state.commit_step)
        raise
    finally:
        if state.commit_step != before:  # the copy was taken, even if the membership check then failed
            held.update(commit=state.commit_step, step=state.step)
            event("commit", commit=state.commit_step, step=state.step, v=elastic.world_version())


@elastic.run(checkpoint_dir=CHECKPOINT, checkpoint_every=2)
def train(state):
    log.setdefault("start_commit", state.commit_step)
    log.setdefault("start_step", state.step)
    for state.epoch in range(state.epoch, EPOCHS):
        sampler.set_epoch(state.epoch)
        for state.batch, (x, y, idx) in enumerate(loader):
            if WORKER == STALL[0] and state.step == int(STALL[1]) and not stalled["done"]:
                stalled["done"] = True
                event("stall", step=state.step)
                time.sleep(float(STALL[2]))
            if state.step == RAISE_AT:
                raise ValueError(f"deterministic user error at step {state.step}")
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            onehot = torch.zeros(SAMPLES, dtype=torch.float64)
            onehot[idx] = 1
            if WORKER in DIVERGE[0].split(",") and state.step >= int(DIVERGE[1]) and not diverged["done"]:
                diverged["done"] = True
                event("diverge", step=state.step, v=elastic.world_version())
                elastic.allreduce(torch.cat([onehot, onehot[:1]]), elastic.Sum)   # fails: the others call 240
            if not SEEN_AFTER_STEP:
                model.seen += elastic.allreduce(onehot, elastic.Sum)
            opt.step()
            kill_here("after-step")
            if SEEN_AFTER_STEP:
                model.seen += elastic.allreduce(onehot, elastic.Sum)
            sampler.record_batch(state.batch, len(x))
            state.step += 1
            kill_here("between")
            progress(f"{state.step} {elastic.size()} {elastic.world_version()}")
            event("step", step=state.step, v=elastic.world_version(), size=elastic.size(), rank=elastic.rank())
            if WORKER == FORK_CHILD[0] and state.step >= int(FORK_CHILD[1]) and not forked["done"]:
                forked["done"] = True
                child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
                child.start()
                event("forked", pid=child.pid, step=state.step, v=elastic.world_version())
            if WORKER == LEAVE_AT[0] and state.step == int(LEAVE_AT[1]):
                event("leave_requested", step=state.step)
                elastic.request_leave("the test asked")
            time.sleep(STEP_SLEEP)
            if state.batch % 3 == 0:
                commit()
                if WORKER == RETURN_AT[0] and state.step >= int(RETURN_AT[1]):
                    event("returning", step=state.step, commit=state.commit_step)
                    log["final_size"] = elastic.size()
                    return
        commit()
        if STOP_FILE:
            # Decided collectively, so every rank leaves after the same epoch.
            stop = torch.tensor([1 if os.path.exists(STOP_FILE) else 0], dtype=torch.int32)
            if elastic.allreduce(stop, elastic.Max).item():
                break
    log["final_size"] = elastic.size()
    # Epochs done: the loop's last, or all of them when a restore or sync landed on the last
    # end-of-epoch commit (a finished epoch is committed as the next, so the loop had none left).
    log["epochs"] = min(state.epoch + 1, EPOCHS)


try:
    train(state)
except elastic.LeftJob as e:
    event("left", commit=e.commit_step, v=e.world_version, step=state.step)
    raise
event("returned", commit=state.commit_step)

digest = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    digest.update(k.encode()); digest.update(v.numpy().tobytes())
for k, v in sorted(opt.state_dict()["state"].items()):
    for name, t in sorted(v.items()):
        digest.update(name.encode()); digest.update(t.numpy().tobytes())
with torch.no_grad():
    final_loss = torch.nn.functional.mse_loss(model(X), Y).item()
result = {"worker": WORKER, "loss": final_loss, "initial_loss": initial_loss, "hash": digest.hexdigest(), "seen": model.seen.tolist(), "step": state.step,
          "commit_step": state.commit_step, "weight": model.linear.weight.detach().view(-1).tolist(),
          "lr": float(opt.param_groups[0]["lr"]), **log}
with open(os.path.join(OUT, f"result-{WORKER}.json"), "w") as f:
    json.dump(result, f)
print(f"worker {WORKER} done at step {state.step}", flush=True)

FINAL_BARRIER = os.environ.get("JOB_FINAL_BARRIER", "")
if FINAL_BARRIER:
    skipper, seconds = FINAL_BARRIER.split(":")
    if WORKER == skipper:
        time.sleep(float(seconds))
    else:
        event("final_barrier")
        torch.distributed.barrier()   # raises when a member never comes, as torch's does on its timeout
        event("final_barrier_passed")
