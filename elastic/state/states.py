"""Committed training state: commit() takes a copy, restore() rolls back to it, sync() makes
every rank hold the commit of the most advanced rank.

A ``State`` takes, encodes and adopts snapshots; when it does is the step protocol of the
worker's session, described in ``elastic.runtime.session``: ``commit()``, ``sync()`` and
``check_membership()`` hand this state to it. A commit copies everything (state dicts and
attributes: copies, not references); on a failure every survivor ``restore()``s its last commit;
a sync makes every rank hold the most advanced rank's live state, including what the reset
callbacks changed (a learning rate rescaled by ``size()``, say).

What is sent and stored is in ``elastic.ring.serialization``'s format, never pickle: reading a
peer's sync payload or a checkpoint file builds tensors, arrays and plain values and runs no
code. So the state may hold only what that format carries (tensors, numpy arrays and scalars,
None/bool/int/float/complex/str/bytes, lists, tuples, dicts); ``commit()`` refuses anything
else, naming the attribute, and the previous commit stays. Durable commits are files of
``elastic.state.checkpoint``: checksummed, the newest two kept, a corrupt newest one skipped.

Durable commits are written off the training thread: the in-memory snapshot of the commit is
handed to the State's ``checkpoint.DurableWriter``, which reads its tensors while training
goes on. Commits are double-buffered (the next copy reuses the buffers of the commit before
last), so a snapshot the writer still holds is never reused: that commit's copy gets fresh
buffers instead, and the file holds exactly the state of its commit.
"""

from __future__ import annotations

import collections
import copy
import logging
import sys
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from elastic.state import checkpoint
from elastic.runtime import step_phase
from elastic.runtime import commit_watch, current
from elastic.runtime.lifecycle import session_now
from elastic.state import sync as state_sync
from elastic.ring import serialization
from elastic.state.sampler import ElasticSampler, committed_attrs

log = logging.getLogger("elastic")


class State:
    """Base class: subclasses say how to copy (``save``) and apply (``load``) their state."""

    def __init__(self) -> None:
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_snapshot", None)
        object.__setattr__(self, "_spare", None)  # the commit before, whose buffers the next commit reuses
        object.__setattr__(self, "commit_step", -1)
        object.__setattr__(self, "_checkpoint_dir", None)
        object.__setattr__(self, "_checkpoint_every", 0)
        object.__setattr__(self, "_writer", None)  # checkpoint.DurableWriter, with durable commits on
        object.__setattr__(self, "_progress", 0)   # steps completed since the last commit, kept live (TorchState)

    # -- what subclasses provide
    def live(self) -> Any:
        """The live state as a structure of dicts, lists, tensors and values (references)."""
        raise NotImplementedError

    def save(self, view: Any = None) -> Any:
        """A deep copy of the live state (or of ``view``, a ``live()`` just taken), reusing the
        spare commit's tensors where they fit (never those the durable writer is still reading)."""
        return _copy_into(self._free_spare(), self.live() if view is None else view)

    def load(self, snapshot: Any) -> None:
        """Makes the live state equal to ``snapshot`` (which it must not keep references into)."""
        raise NotImplementedError

    def _check_committable(self, view: Any) -> None:
        """Raises ``TypeError`` when ``view`` (a ``live()``) holds what the sync format cannot carry."""
        try:
            serialization.check((0, view))  # as sync() sends it: (commit step, state)
        except TypeError as e:
            raise TypeError(f"{type(self).__name__} state cannot be committed: {e}") from None

    # -- the protocol
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions run after every re-form, before the sync (e.g. rescale the lr by size())."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for fn in self._reset_callbacks:
            fn()

    def on_finish(self) -> None:
        """Called on every rank when ``elastic.run``'s function returned, while the last world's
        ring is still up (``ShardedState`` gathers its full model here)."""

    def enable_durable_commits(self, directory: str, every: int) -> None:
        """Every ``every``-th commit, rank 0 also writes it atomically to ``directory`` (on a
        background thread); after losing every worker, a relaunch resumes from it."""
        if every < 1:
            raise ValueError(f"durable commits: every must be >= 1, got {every}")
        # Created 0700; refused (PermissionError) when another user could write it.
        checkpoint.prepare_directory(directory)
        if self._writer is None or self._writer.directory != directory:
            if self._writer is not None:
                self._writer.finish()
            # One writer, so one thread, per State: the State alone knows which of its
            # snapshots the writer may still be reading when it next reuses a buffer.
            object.__setattr__(self, "_writer", checkpoint.DurableWriter(directory))
        object.__setattr__(self, "_checkpoint_dir", directory)
        object.__setattr__(self, "_checkpoint_every", every)

    def _free_spare(self) -> Any:
        """The spare commit, whose buffers the next copy may reuse; None (and dropped) while the
        durable writer still reads it, so that copy allocates fresh buffers instead."""
        spare = self._spare
        if spare is not None and self._writer is not None and self._writer.holds(spare):
            object.__setattr__(self, "_spare", None)
            return None
        return spare

    def _take_snapshot(self, view: Any = None) -> None:
        # Double-buffered: the new copy goes into the commit before last, and only a complete
        # copy replaces the last commit, so a commit that fails half-way loses nothing. The
        # commit before last may be the one the durable writer is reading: then it is not
        # reused (dropped here too, for a subclass whose save() reuses self._spare itself).
        self._free_spare()
        new = self.save(view)
        object.__setattr__(self, "_spare", self._snapshot)
        object.__setattr__(self, "_snapshot", new)

    def commit(self) -> None:
        """Copies the state in memory, then checks for a pending membership change.

        An attribute the sync format cannot carry (a function, a class instance, a set …)
        raises ``TypeError`` naming it, before anything is copied: the last commit stays.
        """
        session_now("State.commit()").commit(self)

    def restore(self) -> None:
        """Rolls the live state back to the last commit (no-op before the first)."""
        if self._snapshot is not None:
            self.load(self._snapshot)
        object.__setattr__(self, "_progress", 0)
        self._settled()

    def live_state_usable(self) -> bool:
        """After a peer's failure: whether the live state can be kept instead of restoring the
        last commit, because the failure cannot have left it half-changed. This base class never
        can (``TorchState`` can; see ``elastic.runtime.step_phase``)."""
        return False

    def keep_live(self) -> None:
        """Keeps the live state after a failure (``live_state_usable`` said it may): it becomes the
        step boundary the next sync compares."""
        raise NotImplementedError(f"{type(self).__name__} cannot keep its live state after a failure")

    def standing(self) -> Tuple[int, int]:
        """How far this state is, as syncs compare it: (its commit step, the steps completed
        since that commit and kept live after a failure)."""
        return self.commit_step, self._progress

    def check_membership(self) -> None:
        """Raises MembershipChanged on every rank at once when a clean join/leave is pending."""
        session_now("State.check_membership()").check_membership()

    def sync(self) -> None:
        """Makes every rank hold the most advanced rank's commit (or rank 0's state before any)."""
        session_now("State.sync()").sync(self)

    # -- snapshots, as the session's step protocol takes and loads them
    def take_commit(self, durable: bool, wait_s: float) -> None:
        """The state's part of ``commit()``: the snapshot, counted, and (``durable``: this rank
        writes durable commits) every ``checkpoint_every``-th commit handed to the durable
        writer, waiting at most ``wait_s`` for the write before it."""
        self.take_snapshot()
        if durable and self._checkpoint_dir and self.commit_step % self._checkpoint_every == 0:
            self.write_checkpoint(wait_s)

    def sync_over(self, comm: Any) -> Tuple[int, int]:
        """The state's part of ``sync()``: the most advanced rank's commit to every rank of
        ``comm`` (``elastic.state.sync``); returns (that rank, the commit step every rank holds)."""
        return state_sync.transfer(comm, self)

    def take_snapshot(self) -> None:
        """The in-memory half of ``commit()``: check, copy, and count the commit."""
        view = self.live()
        self._check_committable(view)
        self._take_snapshot(view)
        object.__setattr__(self, "commit_step", self.commit_step + 1)
        object.__setattr__(self, "_progress", 0)
        self._settled()

    def encode_for_sync(self, step: int, from_checkpoint: bool) -> serialization.Encoded:
        """The sync root's (step, state) to broadcast: the newest durable commit when asked to
        (the job's first sync) and there is one, else its live state (encoded as views, copied
        into the payload right away)."""
        durable = self._read_checkpoint() if from_checkpoint else None
        if durable is not None:
            step, snapshot = durable
        else:
            snapshot = self.live()
            self._check_committable(snapshot)  # names an attribute set since the last commit
        return serialization.encode((step, snapshot))

    def decode_synced(self, payload: np.ndarray, root: int, world_version: int) -> Tuple[int, Any]:
        """The (step, state) that rank ``root`` sent in a sync; ValueError when it is not data of
        the format or not shaped like this state (``check_shape``)."""
        step, snapshot = _decode_sync(payload, root, world_version)
        try:
            self.check_shape(snapshot)
        except Exception as e:   # whatever a peer's values make the checks raise
            raise ValueError(f"sync in world version {world_version}: the state rank {root} sent does not fit "
                             f"this {type(self).__name__}: {e}") from None
        return step, snapshot

    def adopt_synced(self, step: int, snapshot: Any) -> None:
        """Loads a synced (step, state) and makes it the last commit."""
        self.load(snapshot)
        self._take_snapshot()
        object.__setattr__(self, "commit_step", step)
        object.__setattr__(self, "_progress", 0)
        self._settled()

    def adopt_live(self, step: int) -> None:
        """Makes the live state the last commit as ``step``: a sync whose root's state this rank
        holds already, bit for bit (``elastic.state.sync.holders``), ends as ``adopt_synced`` of
        the root's bytes would, with nothing received or decoded and no tensor loaded."""
        self._take_snapshot()
        self._load_own(self._snapshot)
        object.__setattr__(self, "commit_step", step)
        object.__setattr__(self, "_progress", 0)
        self._settled()

    def _load_own(self, snapshot: Any) -> None:
        """What loading ``snapshot``, just taken of this live state, still changes (a finished
        epoch committed as the next one): ``load`` it, unless a subclass knows what to skip."""
        self.load(snapshot)

    def loads_unchanged(self) -> bool:
        """Whether a rank that loads this state's encoding ends with the bits this state holds,
        so that keeping it (``adopt_live``) and loading it agree. A subclass says no where a load
        converts (``TorchState``: an optimizer whose state has another dtype than its parameter)."""
        return True

    def _settled(self) -> None:
        """The live state is a step boundary now: the last commit, a synced state, or a state
        kept after a failure (``TorchState`` tracks what happens after it)."""

    def check_shape(self, snapshot: Any) -> None:
        """ValueError unless ``snapshot`` is shaped like what ``live()`` gives (subclasses say)."""

    # -- durable commits
    def write_checkpoint(self, wait_s: float) -> bool:
        """Hands the commit just taken to the background writer; waits (logged) only while the
        previous write still runs, at most ``wait_s``, and past that leaves this one unwritten
        (logged). Never raises for the disk: failed writes are logged by the writer."""
        return self._writer.submit(self.commit_step, self._snapshot, wait_s, commit_watch.position(self))

    def make_last_commit_durable(self, comm: Any, wait_s: float) -> None:
        """At the run's end the last commit goes to disk too (durable commits on), whatever ``checkpoint_every``."""
        if comm.rank == 0 and self._checkpoint_dir and 0 <= self.commit_step != self._writer.submitted:
            self.write_checkpoint(wait_s)

    def finish_durable_commits(self, timeout_s: Optional[float] = None) -> bool:
        """Waits until the durable commit being written is on disk; False (logged) when it is not
        within ``timeout_s`` (default ``checkpoint.FINISH_TIMEOUT_S``). ``elastic.run`` calls it
        before it returns, and process exit does too."""
        return self._writer is None or self._writer.finish(timeout_s)

    def _read_checkpoint(self) -> Optional[Tuple[int, Any]]:
        """The newest usable durable commit (a corrupt newest one is logged and skipped)."""
        if not self._checkpoint_dir:
            return None
        found = checkpoint.read_latest(self._checkpoint_dir)
        if found is None:
            return None
        step, snapshot, path = found
        log.info("resuming from durable commit %d in %s", step, path)
        return step, snapshot


def _decode_sync(payload: np.ndarray, root: int, world_version: int) -> Tuple[int, Any]:
    try:
        value = serialization.loads(payload)
    except ValueError as e:
        raise ValueError(f"sync in world version {world_version}: the state rank {root} sent is malformed: "
                         f"{e}") from None
    if type(value) is not tuple or len(value) != 2 or type(value[0]) is not int or value[0] < -1:
        raise ValueError(f"sync in world version {world_version}: rank {root} sent no (commit step, state) pair")
    return value


class ObjectState(State):
    """Committed plain attributes: ``state = ObjectState(epoch=0, batch=0)``; ``state.epoch += 1``.

    Every attribute set on it is committed, except names starting with ``_`` and names of the
    class's own methods (``state.sync = wrapper`` replaces a method, it is not state).
    """

    _NOT_ATTRIBUTES = ("commit_step",)

    def __init__(self, **attrs: Any) -> None:
        super().__init__()
        bad = [k for k in attrs if not self._is_attribute(k)]
        if bad:
            raise ValueError(f"{type(self).__name__}({bad[0]}=...): that name is not a committed attribute (names "
                             "starting with '_' and method names are not); choose another")
        object.__setattr__(self, "_names", list(attrs))
        for k, v in attrs.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._names and self._is_attribute(name):
            self._names.append(name)
        object.__setattr__(self, name, value)

    def _plain(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self._names}

    def _check_committable(self, view: Any) -> None:
        """Raises ``TypeError`` naming the attribute (or the model/optimizer) that the sync format
        cannot carry; checks the whole view first, so a committable state is walked once."""
        try:
            serialization.check((0, view))
            return
        except TypeError as whole:
            error = whole
        cls = type(self).__name__
        for name, value in view.get("attrs", {}).items():
            try:
                serialization.check(value)
            except TypeError as e:
                raise TypeError(f"{cls} attribute {name!r} of type {type(value).__name__} cannot be committed: "
                                f"{e}") from None
        for name, sd in view.get("handlers", {}).items():
            try:
                serialization.check(sd)
            except TypeError as e:
                raise TypeError(f"{cls} attribute {name!r} of type {type(getattr(self, name)).__name__} cannot be "
                                f"committed: its state_dict() holds {e}") from None
        for part in ("model", "optimizer"):
            if part in view:
                try:
                    serialization.check(view[part])
                except TypeError as e:
                    raise TypeError(f"{cls} {part} cannot be committed: its state_dict() holds {e}") from None
        raise TypeError(f"{cls} state cannot be committed: {error}")

    def live(self) -> Any:
        return {"attrs": self._plain()}

    def _is_attribute(self, name: Any) -> bool:
        """Whether ``name`` may be a committed attribute: what ``__setattr__`` records."""
        return (type(name) is str and not name.startswith("_") and name not in self._NOT_ATTRIBUTES
                and not hasattr(type(self), name))

    def _check_attribute_names(self, snapshot: Any) -> None:
        # A snapshot that arrived from a peer or a file names the attributes it sets: none of
        # them may be this object's own machinery (a method, the checkpoint directory, …).
        bad = [k for k in snapshot["attrs"] if not self._is_attribute(k)]
        if bad:
            raise ValueError(f"{type(self).__name__}: the state to load sets {bad[0]!r}, which is not a committed "
                             "attribute (names starting with '_' and method names are not)")

    def _load_attributes(self, attrs: Dict[str, Any]) -> None:
        for k, v in copy.deepcopy(attrs).items():
            object.__setattr__(self, k, v)
            if k not in self._names:
                self._names.append(k)

    def check_shape(self, snapshot: Any) -> None:
        if type(snapshot) is not dict or type(snapshot.get("attrs")) is not dict:
            raise ValueError("expected a dict with an 'attrs' dict")
        if "handlers" in snapshot and type(snapshot["handlers"]) is not dict:
            raise ValueError("'handlers' is not a dict")
        self._check_attribute_names(snapshot)

    def load(self, snapshot: Any) -> None:
        self._check_attribute_names(snapshot)
        self._load_attributes(snapshot["attrs"])


def _copy_into(old: Any, new: Any) -> Any:
    """A deep copy of ``new``, reusing ``old``'s tensors where structure, shape and dtype match."""
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch is not None and isinstance(new, torch.Tensor):
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        old = old if isinstance(old, dict) else {}
        if type(new) is collections.OrderedDict:  # a state_dict(): keep its type and _metadata
            out = collections.OrderedDict((k, _copy_into(old.get(k), v)) for k, v in new.items())
            if getattr(new, "_metadata", None) is not None:
                out._metadata = copy.deepcopy(new._metadata)
            return out
        return {k: _copy_into(old.get(k), v) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        old = old if isinstance(old, type(new)) and len(old) == len(new) else [None] * len(new)
        return type(new)(_copy_into(o, v) for o, v in zip(old, new))
    return copy.deepcopy(new)


def _short(key: Any) -> str:
    return repr(key)[:80]


def _describe(v: Any) -> str:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {list(v.shape)}"
    return f"a {type(v).__name__}"


def _check_tensors_fit(got: Any, live: Dict[str, Any], what: str) -> None:
    """ValueError unless ``got`` has exactly ``live``'s keys and, where ``live`` holds a tensor, a
    tensor of the same shape and dtype (what ``load_state_dict`` would otherwise fail on, half-way)."""
    torch = sys.modules.get("torch")
    missing = [k for k in live if k not in got]
    extra = [k for k in got if k not in live]
    if missing or extra:
        raise ValueError(f"{what} keys differ: missing {[_short(k) for k in missing[:5]]}, unexpected "
                         f"{[_short(k) for k in extra[:5]]}")
    for k, v in live.items():
        if torch is not None and isinstance(v, torch.Tensor):
            g = got[k]
            if not isinstance(g, torch.Tensor) or g.shape != v.shape or g.dtype != v.dtype:
                raise ValueError(f"{what}[{_short(k)}] is {_describe(g)}, this state's is {_describe(v)}")


def _check_optimizer_fits(got: Dict[str, Any], live: Dict[str, Any]) -> None:
    """ValueError unless ``got`` is an optimizer state dict ``load_state_dict`` of the optimizer
    whose ``state_dict()`` is ``live`` takes without failing, now or at its next step."""
    torch = sys.modules.get("torch")
    groups, state = got.get("param_groups"), got.get("state")
    if type(groups) is not list or not isinstance(state, dict):
        raise ValueError("'optimizer' is not an optimizer state dict (state, param_groups)")
    if len(groups) != len(live["param_groups"]):
        raise ValueError(f"the optimizer has {len(groups)} param groups, this state's {len(live['param_groups'])}")
    ids: List[Any] = []
    for i, (g, mine) in enumerate(zip(groups, live["param_groups"])):
        if not isinstance(g, dict) or type(g.get("params")) is not list or len(g["params"]) != len(mine["params"]):
            raise ValueError(f"optimizer param group {i} does not hold {len(mine['params'])} parameters as this "
                             "state's does")
        if set(g) != set(mine):
            raise ValueError(f"optimizer param group {i} has the settings {sorted(map(_short, g))[:12]}, this "
                             f"state's {sorted(map(_short, mine))[:12]}")
        for k, v in mine.items():
            if k == "params" or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)) and (isinstance(g[k], bool) or not isinstance(g[k], (int, float))):
                raise ValueError(f"optimizer param group {i} setting {_short(k)} is {_describe(g[k])}, not a number")
            if torch is not None and isinstance(v, torch.Tensor) and (not isinstance(g[k], torch.Tensor)
                                                                       or g[k].shape != v.shape):
                raise ValueError(f"optimizer param group {i} setting {_short(k)} is {_describe(g[k])}, this "
                                 f"state's is {_describe(v)}")
        ids += g["params"]
    if any(isinstance(p, bool) or not isinstance(p, int) for p in ids) or len(set(ids)) != len(ids):
        raise ValueError("the optimizer's parameter ids are not distinct integers")
    to_live = dict(zip(ids, (p for mine in live["param_groups"] for p in mine["params"])))
    for pid, st in state.items():
        if pid not in to_live or not isinstance(st, dict):
            raise ValueError(f"optimizer state for parameter {_short(pid)}, which no param group holds")
        mine = live["state"].get(to_live[pid])
        if mine is None:
            continue   # no state for it here yet (a newcomer): nothing to compare with
        for k, v in mine.items():
            if torch is not None and isinstance(v, torch.Tensor) and k in st and (
                    not isinstance(st[k], torch.Tensor) or st[k].shape != v.shape):
                raise ValueError(f"optimizer state {_short(k)} of parameter {pid} is {_describe(st[k])}, this "
                                 f"state's is {_describe(v)}")


class TorchState(ObjectState):
    """Committed model, optimizer and attributes. Attributes with ``state_dict``/``load_state_dict``
    (an ``ElasticSampler``, an lr scheduler) are committed through those; others are deep-copied.

    After a peer's failure it keeps its live state, restoring nothing, when the failure surfaced
    after a step's training forward began and before its optimizer changed anything
    (``elastic.runtime.step_phase`` says when; the model's forward pre-hook, the optimizer's step hooks
    and the sampler's ``record_batch`` tell it where the step stands). Parameters and optimizer
    state are kept as they are; the model's persistent buffers go back to their values at the
    end of the last completed step (a failed forward changed BatchNorm's running statistics),
    copied as each step's training forward begins; gradients are dropped; attributes are kept
    as they are (the loop's bookkeeping of that step ran before the next forward).
    """

    _NOT_ATTRIBUTES = ("commit_step", "model", "optimizer")  # committed through their state_dict()

    def __init__(self, model: Any = None, optimizer: Any = None, **attrs: Any) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_phase", step_phase.Phase.BOUNDARY)
        object.__setattr__(self, "_buffers_at_step", None)   # name -> copy of the buffer at the last boundary
        object.__setattr__(self, "_samplers", [])            # ElasticSamplers that report recorded batches here
        object.__setattr__(self, "_tracked", [])             # the model and optimizers whose hooks report here
        super().__init__(**attrs)
        me = weakref.ref(self)   # hooks must not keep an old state alive (and copying buffers)
        if model is not None and hasattr(model, "register_forward_pre_hook"):
            model.register_forward_pre_hook(_uncompiled(lambda module, args: _tell(me, step_phase.Event.FORWARD)))
            self._tracked.append(model)
        for value in [optimizer, *attrs.values()]:
            self._follow(value)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        self._follow(value)

    def _follow(self, value: Any) -> None:
        """Hooks an ElasticSampler's records and a torch optimizer's steps (held as the optimizer or
        as an attribute: a second optimizer stepping in the same step makes the step unpaired)."""
        # Runs at every attribute set (state.step += 1 each step): the type tests come first.
        sampler = isinstance(value, ElasticSampler)
        if not (sampler or (hasattr(value, "register_step_pre_hook") and hasattr(value, "param_groups"))) or \
                any(value is t for t in self._samplers + self._tracked):
            return
        me = weakref.ref(self)
        if sampler:
            self._samplers.append(value)
            value.add_record_listener(self._batch_recorded)
        else:
            # A DistributedOptimizer's step() runs these hooks twice: around itself (its
            # synchronize() and the update) and around the wrapped optimizer's update alone. Only
            # the inner pair, past synchronize(), counts: a failure inside synchronize() has
            # changed nothing.
            value.register_step_pre_hook(_uncompiled(
                lambda opt, args, kwargs: _tell(me, step_phase.Event.UPDATE_BEGINS)
                if getattr(opt, "_elastic_synchronized", True) else None))
            value.register_step_post_hook(_uncompiled(
                lambda opt, args, kwargs: _tell(me, step_phase.Event.UPDATE_ENDS)
                if getattr(opt, "_elastic_synchronized", True) else None))
            self._tracked.append(value)

    # -- where the step stands (elastic.runtime.step_phase)
    def _step_event(self, event: step_phase.Event) -> None:
        if event is step_phase.Event.FORWARD:
            torch = sys.modules["torch"]
            if not torch.is_grad_enabled():
                return   # an evaluation: not a training step
        before = self._phase
        phase = step_phase.advance(before, event, records_batches=bool(self._samplers))
        object.__setattr__(self, "_phase", phase)
        if step_phase.completes_a_step(before, phase):
            object.__setattr__(self, "_progress", self._progress + 1)
            self._copy_buffers()
            session = current.session()
            if session is not None:
                session.stepped()   # counts toward the warning of a job that does not commit

    def _batch_recorded(self) -> None:
        self._step_event(step_phase.Event.BATCH_RECORDED)

    def _settled(self) -> None:
        object.__setattr__(self, "_phase", step_phase.Phase.BOUNDARY)
        self._copy_buffers()

    def _persistent_buffers(self) -> Iterator[Tuple[str, Any]]:
        """The model's buffers a state dict holds (what a forward may change: running
        statistics), not the non-persistent ones (masks, caches), by name."""
        for prefix, module in self.model.named_modules():
            skip = getattr(module, "_non_persistent_buffers_set", ())
            for name, b in module._buffers.items():
                if b is not None and name not in skip:
                    yield (f"{prefix}.{name}" if prefix else name), b

    def _copy_buffers(self) -> None:
        if self.model is None or not hasattr(self.model, "named_modules"):
            return
        # Into the last copy's tensors where they still fit (no allocation per step).
        object.__setattr__(self, "_buffers_at_step", _copy_into(self._buffers_at_step,
                                                                dict(self._persistent_buffers())))

    def live_state_usable(self) -> bool:
        # Only what the hooks follow can be kept: this model's forwards and this optimizer's steps.
        tracked = self.model is not None and self.optimizer is not None and \
            any(self.model is t for t in self._tracked) and any(self.optimizer is t for t in self._tracked)
        if not tracked or not step_phase.harmless(self._phase):
            log.info("the failure came where the live state may be half-changed (%s; elastic.runtime.step_phase): "
                     "restoring the last commit", self._phase.value if tracked else "no model and optimizer followed")
            return False
        return True

    def keep_live(self) -> None:
        torch = sys.modules["torch"]
        with torch.no_grad():   # the copy goes back into the live buffers (same names, shapes, dtypes)
            _copy_into(dict(self._persistent_buffers()), self._buffers_at_step or {})
        # Gradients of the abandoned step (some already reduced in place) must not leak into the
        # next one, nor must a DistributedOptimizer's in-flight bookkeeping.
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._settled()
        return True

    def _handlers(self) -> Dict[str, Any]:
        return {k: v for k, v in self._plain().items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}

    def live(self) -> Any:
        handlers = self._handlers()
        view: Dict[str, Any] = {
            # A finished epoch is committed as the next one (elastic.state.sampler.committed_attrs).
            "attrs": committed_attrs({k: v for k, v in self._plain().items() if k not in handlers}, handlers),
            "handlers": {k: v.state_dict() for k, v in handlers.items()},
        }
        if self.model is not None:
            view["model"] = self.model.state_dict()
        if self.optimizer is not None:
            view["optimizer"] = self.optimizer.state_dict()
        return view

    def check_shape(self, snapshot: Any) -> None:
        """ValueError unless ``snapshot`` fits this state, checked before anything is loaded: the
        model's keys, shapes and dtypes are the live model's; the optimizer has the same param
        groups (sizes and hyperparameter names) and, for every parameter it already has state
        for, tensors of the same shapes (a newcomer's optimizer, with no state yet, checks the
        structure only); a handler's state is a dict, checked by its ``check_state_dict`` when it
        has one (``ElasticSampler`` does)."""
        super().check_shape(snapshot)
        for part in ("model", "optimizer"):
            if part in snapshot and not isinstance(snapshot[part], dict):
                raise ValueError(f"'{part}' is not a state dict")
        if self.model is not None:
            if "model" not in snapshot:
                raise ValueError("it holds no model state; this TorchState has a model")
            _check_tensors_fit(snapshot["model"], self.model.state_dict(), "model")
        if self.optimizer is not None and "optimizer" in snapshot:
            _check_optimizer_fits(snapshot["optimizer"], self.optimizer.state_dict())
        handlers = self._handlers()
        for name, sd in snapshot.get("handlers", {}).items():
            if name in handlers:
                if not isinstance(sd, dict):
                    raise ValueError(f"the state of attribute {name!r} is not a dict")
                check = getattr(handlers[name], "check_state_dict", None)
                if callable(check):
                    check(sd)

    def load(self, snapshot: Any) -> None:
        self._load(snapshot, tensors=True)

    def _load_own(self, snapshot: Any) -> None:
        # The model's and optimizer's tensors are what the snapshot was just copied from.
        self._load(snapshot, tensors=False)

    def loads_unchanged(self) -> bool:
        # Optimizer.load_state_dict casts each floating state tensor but "step" to its
        # parameter's dtype and device (fp32 moments of bf16 parameters become bf16), and load
        # hooks may change anything: a rank that loaded would then differ from one that kept.
        opt = self.optimizer
        if opt is not None:
            if getattr(opt, "_optimizer_load_state_dict_pre_hooks", None) or \
                    getattr(opt, "_optimizer_load_state_dict_post_hooks", None):
                return False
            torch = sys.modules["torch"]
            for param, st in getattr(opt, "state", {}).items():
                if not isinstance(param, torch.Tensor) or not isinstance(st, dict):
                    return False
                for key, v in st.items():
                    if key != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and (
                            v.dtype != param.dtype or v.device != param.device):
                        return False
        if self.model is not None and hasattr(self.model, "modules"):
            if any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in self.model.modules()):
                return False
        return True

    def _load(self, snapshot: Any, tensors: bool) -> None:
        self._check_attribute_names(snapshot)
        if tensors and self.model is not None and "model" in snapshot:
            self.model.load_state_dict(snapshot["model"])
        if self.optimizer is not None:
            if tensors and "optimizer" in snapshot:
                self.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
            # Gradients of an abandoned step (some already reduced in place) must not leak
            # into the next one, nor must a DistributedOptimizer's in-flight bookkeeping.
            self.optimizer.zero_grad(set_to_none=True)
        handlers = self._handlers()
        for k, sd in snapshot.get("handlers", {}).items():
            if k in handlers:
                handlers[k].load_state_dict(copy.deepcopy(sd))
        self._load_attributes(snapshot["attrs"])


def _uncompiled(hook: Callable) -> Callable:
    """``hook`` left out of torch.compile's graphs (it is bookkeeping in Python, run eagerly)."""
    return sys.modules["torch"].compiler.disable(hook)


def _tell(ref: "weakref.ref[TorchState]", event: step_phase.Event) -> None:
    state = ref()
    if state is not None:
        state._step_event(event)


def training_forward_begins(state: Any, module: Any) -> None:
    """A DDP wrapper of ``module`` begins a forward (before its buffer broadcast, a collective a
    peer's failure may surface in; the model's own pre-hook runs after it): ``state``, the State
    ``elastic.run`` runs, learns it when it holds ``module``."""
    if isinstance(state, TorchState) and state.model is module:
        state._step_event(step_phase.Event.FORWARD)
