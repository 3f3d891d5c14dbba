"""Committed training state: commit() takes a copy, restore() rolls back to it, sync() makes
every rank hold the commit of the most advanced rank.

The protocol, as ``elastic.run`` drives it:
- ``commit()`` copies everything (state dicts and attributes: copies, not references), then runs
  ``check_membership()``, so a clean join or leave takes effect at the same commit on every rank.
- on ``WorkerLostError`` every survivor ``restore()``s its last commit;
- after every re-form (and the reset callbacks), ``sync()`` agrees (one allgather) on the highest
  commit step and broadcasts that rank's state to everyone, newcomers included; everyone loads
  the same bytes, so all ranks then hold the same bits. The broadcast state is the root's live
  state: after a failure that is its restored commit, after a clean change it is where every
  rank stopped (nothing is rolled back), and either way it includes what the reset callbacks
  changed (a learning rate rescaled by ``size()``, say).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import sys
import tempfile
from typing import Any, Callable, Dict, Iterable

import numpy as np

from . import collectives, runtime
from .errors import MembershipChanged
from .ops import Max

log = logging.getLogger("elastic")

_CHECKPOINT_NAME = "elastic-commit.pt"


class State:
    """Base class: subclasses say how to copy (``save``) and apply (``load``) their state."""

    def __init__(self) -> None:
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "_spare", None)  # the commit before, whose buffers the next commit reuses
        object.__setattr__(self, "commit_step", -1)
        object.__setattr__(self, "_checkpoint_dir", None)
        object.__setattr__(self, "_checkpoint_every", 0)

    # -- what subclasses provide
    def live(self) -> Any:
        """The live state as a structure of dicts, lists, tensors and values (references)."""
        raise NotImplementedError

    def save(self) -> Any:
        """A deep copy of the live state, reusing the spare commit's tensors where they fit."""
        return _copy_into(self._spare, self.live())

    def load(self, snapshot: Any) -> None:
        """Makes the live state equal to ``snapshot`` (which it must not keep references into)."""
        raise NotImplementedError

    def serialize(self, snapshot: Any) -> bytes:
        import pickle
        return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)

    def deserialize(self, data: bytes) -> Any:
        import pickle
        return pickle.loads(data)

    # -- the protocol
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions run after every re-form, before the sync (e.g. rescale the lr by size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for fn in self._reset_callbacks:
            fn()

    def enable_durable_commits(self, directory: str, every: int) -> None:
        """Every ``every``-th commit, rank 0 also writes it atomically to ``directory``; after losing
        every worker, a relaunch resumes from it."""
        if every < 1:
            raise ValueError(f"durable commits: every must be >= 1, got {every}")
        os.makedirs(directory, exist_ok=True)
        object.__setattr__(self, "_checkpoint_dir", directory)
        object.__setattr__(self, "_checkpoint_every", every)

    def _take_snapshot(self) -> None:
        # Double-buffered: the new copy goes into the commit before last, and only a complete
        # copy replaces the last commit, so a commit that fails half-way loses nothing.
        new = self.save()
        object.__setattr__(self, "_spare", self._snapshot)
        object.__setattr__(self, "_snapshot", new)

    def commit(self) -> None:
        """Copies the state in memory, then checks for a pending membership change."""
        self._take_snapshot()
        object.__setattr__(self, "commit_step", self.commit_step + 1)
        rt = runtime._runtime
        if rt is not None:
            rt.record_commit(self.commit_step)
        if self._checkpoint_dir and self.commit_step % self._checkpoint_every == 0 and _rank_or_zero() == 0:
            self._write_checkpoint()
        self.check_membership()

    def restore(self) -> None:
        """Rolls the live state back to the last commit (no-op before the first)."""
        if self._snapshot is not None:
            self.load(self._snapshot)

    def check_membership(self) -> None:
        """Raises MembershipChanged on every rank at once when a clean join/leave is pending.

        One 4-byte allreduce: a rank that has heard of the change tells all the others, so
        they all switch at this same commit.
        """
        rt = runtime._runtime
        comm = collectives.current_communicator()
        flag = np.array([1 if rt is not None and rt.membership_pending() else 0], dtype=np.int32)
        comm.allreduce_(flag, Max)
        if flag[0]:
            raise MembershipChanged(f"membership of world version {comm.world_version} changed; re-forming")

    def sync(self) -> None:
        """Makes every rank hold the most advanced rank's commit (or rank 0's state before any)."""
        comm = collectives.current_communicator()
        steps = comm.allgather(np.array([self.commit_step], dtype=np.int64))
        root = int(np.argmax(steps))  # the lowest rank among those with the highest step
        step = int(steps[root])
        if comm.rank == root:
            durable = self._read_checkpoint() if step < 0 and root == 0 else None
            if durable is not None:
                step, snapshot = durable
            else:
                snapshot = self.live()  # serialized right away: a view is enough
            payload = np.frombuffer(self.serialize((step, snapshot)), dtype=np.uint8).copy()
            size = np.array([payload.size], dtype=np.int64)
        else:
            size = np.zeros(1, dtype=np.int64)
        comm.broadcast_(size, root_rank=root)
        if comm.rank != root:
            payload = np.empty(int(size[0]), dtype=np.uint8)
        comm.broadcast_(payload, root_rank=root)
        # Every rank, the root too, loads the same bytes: identical state by construction.
        step, snapshot = self.deserialize(payload.tobytes())
        self.load(snapshot)
        self._take_snapshot()
        object.__setattr__(self, "commit_step", step)
        rt = runtime._runtime
        if rt is not None:
            rt.record_commit(step)

    # -- durable commits
    def _write_checkpoint(self) -> None:
        data = self.serialize((self.commit_step, self._snapshot))
        fd, tmp = tempfile.mkstemp(dir=self._checkpoint_dir, prefix=".commit-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self._checkpoint_dir, _CHECKPOINT_NAME))  # atomic
            dir_fd = os.open(self._checkpoint_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself survives a crash of the machine
            finally:
                os.close(dir_fd)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _read_checkpoint(self):
        if not self._checkpoint_dir:
            return None
        path = os.path.join(self._checkpoint_dir, _CHECKPOINT_NAME)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            step, snapshot = self.deserialize(f.read())
        log.info("resuming from durable commit %d in %s", step, path)
        return step, snapshot


def _rank_or_zero() -> int:
    rt = runtime._runtime
    return rt.world.rank if rt is not None and rt.world is not None else 0


class ObjectState(State):
    """Committed plain attributes: ``state = ObjectState(epoch=0, batch=0)``; ``state.epoch += 1``."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_names", list(attrs))
        for k, v in attrs.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self._names and name != "commit_step":
            self._names.append(name)
        object.__setattr__(self, name, value)

    def _plain(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self._names}

    def live(self) -> Any:
        return {"attrs": self._plain()}

    def load(self, snapshot: Any) -> None:
        for k, v in copy.deepcopy(snapshot["attrs"]).items():
            object.__setattr__(self, k, v)
            if k not in self._names:
                self._names.append(k)


def _copy_into(old: Any, new: Any) -> Any:
    """A deep copy of ``new``, reusing ``old``'s tensors where structure, shape and dtype match."""
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch is not None and isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        old = old if isinstance(old, dict) else {}
        return {k: _copy_into(old.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        old = old if isinstance(old, type(new)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_into(o, v) for o, v in zip(old, new))
    return copy.deepcopy(new)


class TorchState(ObjectState):
    """Committed model, optimizer and attributes. Attributes with ``state_dict``/``load_state_dict``
    (an ``ElasticSampler``, an lr scheduler) are committed through those; others are deep-copied."""

    def __init__(self, model: Any = None, optimizer: Any = None, **attrs: Any) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        super().__init__(**attrs)

    def _handlers(self) -> Dict[str, Any]:
        return {k: v for k, v in self._plain().items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}

    def live(self) -> Any:
        handlers = self._handlers()
        view: Dict[str, Any] = {
            "attrs": {k: v for k, v in self._plain().items() if k not in handlers},
            "handlers": {k: v.state_dict() for k, v in handlers.items()},
        }
        if self.model is not None:
            view["model"] = self.model.state_dict()
        if self.optimizer is not None:
            view["optimizer"] = self.optimizer.state_dict()
        return view

    def load(self, snapshot: Any) -> None:
        if self.model is not None and "model" in snapshot:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None:
            if "optimizer" in snapshot:
                self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
            # Gradients of an abandoned step (some already reduced in place) must not leak
            # into the next one, nor must a DistributedOptimizer's in-flight bookkeeping.
            self.optimizer.zero_grad(set_to_none=True)
        handlers = self._handlers()
        for k, sd in snapshot.get("handlers", {}).items():
            if k in handlers:
                handlers[k].load_state_dict(copy.deepcopy(sd))
        for k, v in copy.deepcopy(snapshot["attrs"]).items():
            object.__setattr__(self, k, v)

    def serialize(self, snapshot: Any) -> bytes:
        import torch
        buf = io.BytesIO()
        torch.save(snapshot, buf)
        return buf.getvalue()

    def deserialize(self, data: bytes) -> Any:
        import torch
        return torch.load(io.BytesIO(data), weights_only=False)
