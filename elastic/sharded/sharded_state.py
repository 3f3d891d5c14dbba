"""``elastic.ShardedState``: a model sharded with FSDP2 over the elastic ring, committed in
memory on each rank and on its buddy, and resharded live onto every new world.

    state = elastic.ShardedState(build, shard, optimizer=lambda params: torch.optim.AdamW(params),
                                 sampler=sampler, step=0)

For every world the state makes ``state.model`` and ``state.optimizer`` afresh: ``build()`` (a
full, unsharded model; the meta device is allowed), ``shard(model, mesh)`` (the user's FSDP2
plan) with the world's 1-D mesh, ``optimizer(params)`` over the sharded parameters, and then
the committed state loaded onto them. Plain FSDP2 code runs unchanged in between.

A commit copies this rank's shards (parameters, and optimizer states shaped like them) once, into
one flat buffer, and the replicated rest (attributes, buffers, optimizer settings and scalars),
and sends that buffer as it is to the buddy, the next rank round the ring (``Communicator.shift``;
both sides know its layout, see ``elastic.sharded.transfer``). Its agreement is the membership allreduce every commit
ends with: a rank promotes the new copies only once that allreduce completed, which proves
every rank had its copies before (see ``elastic.sharded.reshard.decide``). So the loss of any worker,
and of any set of workers that are not each other's buddies, loses nothing.

On a new world, as soon as its ring forms (the step protocol's ``world_changed`` hook, which
the state registers at its first sync), every rank announces which committed layout it holds,
all decide the same way (``elastic.sharded.reshard``) which commit to resume from and who sends which
rows, the rows that change owner travel point to point, the shorter way round the ring (a
rank receives only rows it takes or passes on), and every rank loads its new shards: bytes are
copied, never computed, so the full state is bitwise the commit. The reset callbacks then run
on the new model and optimizer, and ``sync`` commits the new layout again (own copy and buddy
copy; a buddy takes the rows it holds already in its copies of the commit resumed from, so only
the rest travel; after a resume from disk and in the first world, whole copies do), so the next
failure finds it held twice. A commit whose shards died with both holders is restored from the
newest durable commit when there is one (``elastic.run(checkpoint_dir=...)``), else every rank
raises ``CommitLostError``.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from elastic.ring.errors import BadPeerError, ElasticError, ErrorKind
from elastic.ring.ops import Sum
from elastic.runtime import commit_watch, hooks, lifecycle
from elastic.runtime.errors import LeftJob, MembershipChanged
from elastic.sharded import checkpoint as durable_format
from elastic.sharded import reshard, transfer
from elastic.state import checkpoint
from elastic.state.sampler import committed_attrs
from elastic.state.states import ObjectState

log = logging.getLogger("elastic")



class CommitLostError(ElasticError):
    """Both holders of some rank's committed shards are gone and there is no durable commit to
    restore from: the job cannot go on. Raised on every rank of the world that found it."""

    __module__ = "elastic"   # its public name, whatever module defines it


class ShardedState(ObjectState):
    """Committed FSDP2 model, optimizer and attributes, resharded onto every world (module doc).

    ``build()`` returns a fresh unsharded model (the meta device is allowed once a commit
    exists: its values come from the commit); ``shard(model, mesh)`` applies FSDP2;
    ``optimizer(params)`` makes the optimizer. Other keyword arguments are committed attributes
    as in ``ObjectState``; one with ``state_dict``/``load_state_dict`` (an ``ElasticSampler``,
    an lr scheduler) is committed through those, as in ``TorchState``.
    """

    _NOT_ATTRIBUTES = ("commit_step", "model", "optimizer")

    def __init__(self, build: Callable[[], torch.nn.Module], shard: Callable[[torch.nn.Module, Any], Any],
                 optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None, **attrs: Any) -> None:
        if not callable(build) or not callable(shard) or (optimizer is not None and not callable(optimizer)):
            raise TypeError("ShardedState(build, shard, optimizer=...): build, shard and optimizer are functions "
                            "(build() -> model; shard(model, mesh); optimizer(params) -> optimizer)")
        for k, v in (("_build", build), ("_shard", shard), ("_make_optimizer", optimizer), ("model", None),
                     ("optimizer", None), ("_own", None), ("_buddy", None), ("_held", None), ("_full", None),
                     ("_pending", None), ("_reset_due", False), ("last_reshard", None),
                     ("_written", None), ("_resharded", None),
                     ("_hooks", _ReshardOnNewWorld(self))):
            object.__setattr__(self, k, v)
        super().__init__(**attrs)

    # ------------------------------------------------------------------ the live state, in parts
    def _handlers(self) -> Dict[str, Any]:
        return {k: v for k, v in self._plain().items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}

    def _params(self) -> List[Tuple[str, Any]]:
        return list(self.model.named_parameters())

    def _parts(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """(this rank's shards by key, the replicated rest) of the live state, as references."""
        shards: Dict[str, torch.Tensor] = {}
        table: List[list] = []
        for fqn, p in self._params():
            if not transfer.is_dtensor(p):
                raise ValueError(f"ShardedState: parameter {fqn!r} is not sharded; shard(model, mesh) must apply "
                                 "fully_shard to every module that holds parameters (at least the root)")
            shards["model." + fqn] = transfer.local_rows(p, f"parameter {fqn!r}")
            table.append(["model." + fqn, list(p.shape), str(p.dtype)])
        scalars: Dict[str, Any] = {}
        groups: List[dict] = []
        if self.optimizer is not None:
            names = {id(p): fqn for fqn, p in self._params()}
            for g in self.optimizer.param_groups:
                unknown = [p for p in g["params"] if id(p) not in names]
                if unknown:
                    raise ValueError("ShardedState: the optimizer holds a parameter that is not the model's")
                groups.append({**{k: v for k, v in g.items() if k != "params"},
                               "params": [names[id(p)] for p in g["params"]]})
                for p in g["params"]:
                    for name, v in sorted(self.optimizer.state.get(p, {}).items()):
                        key = f"optim.{names[id(p)]}.{name}"
                        if transfer.is_dtensor(v):
                            if tuple(v.shape) != tuple(p.shape):
                                raise ValueError(f"ShardedState: optimizer state {key!r} is a DTensor not shaped "
                                                 "like its parameter; only states shaped like it are supported")
                            shards[key] = transfer.local_rows(v, f"optimizer state {key!r}")
                            table.append([key, list(v.shape), str(v.dtype)])
                        else:
                            scalars[key] = v
        handlers = self._handlers()
        replicated = {
            "attrs": committed_attrs({k: v for k, v in self._plain().items() if k not in handlers}, handlers),
            "handlers": {k: v.state_dict() for k, v in handlers.items()},
            "buffers": {fqn: b for fqn, b in self.model.named_buffers()},
            "groups": groups, "scalars": scalars, "table": table,
        }
        return shards, replicated

    def live(self) -> Any:
        shards, replicated = self._parts()
        return {"shards": shards, "replicated": replicated}

    def restore(self) -> None:
        """Nothing to roll back here: the next world's ``sync`` rebuilds the model and optimizer
        from the committed shards (the live ones may be half-way through a step)."""

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> Dict[str, int]:
        """Bytes of model and optimizer state this rank holds: ``live`` shards, its ``own``
        committed copy, its ``buddy`` copy (the previous rank's shards), and ``full``, the whole
        unsharded model and optimizer state (one rank's view of the job)."""
        live = own = buddy = full = 0
        if self.model is not None:
            shards, replicated = self._parts()
            rest = transfer.nbytes(replicated["buffers"]) + transfer.nbytes(replicated["scalars"])
            live = transfer.nbytes(shards) + rest
            full = sum(math.prod(s) * torch.empty((), dtype=transfer.dtype_named(d)).element_size()
                       for _, s, d in replicated["table"])
            full += rest
        if self._own is not None:
            own = transfer.nbytes(self._own["shards"]) + transfer.nbytes(self._own["replicated"]["buffers"]) + \
                transfer.nbytes(self._own["replicated"]["scalars"])
        if self._buddy is not None:
            buddy = transfer.nbytes(self._buddy["shards"])
        return {"live": live, "own": own, "buddy": buddy, "full": full}

    # ------------------------------------------------------------------ commit
    def commit(self) -> None:
        """Copies this rank's shards and the replicated state, sends the shards to the buddy,
        then checks for a pending membership change (the commit's agreement)."""
        session = lifecycle.session_now("ShardedState.commit()")
        with session.timed(self, "commit"):
            if self.model is None:
                raise RuntimeError("ShardedState.commit(): there is no model yet; commit inside the function "
                                   "elastic.run runs")
            comm = session.ring("ShardedState.commit()")
            step = self.commit_step + 1

            def boundary() -> None:   # as the step protocol's commit: recorded, the hooks, the membership check
                session.boundary(self, step, comm)

            try:
                self._take_copies(comm, step, boundary)
            finally:
                if self._checkpoint_dir and self._held is not None and self._held[0].step == self.commit_step and \
                        self.commit_step % self._checkpoint_every == 0 and self._written != self.commit_step:
                    self._write_durable(comm)

    def enable_durable_commits(self, directory: str, every: int) -> None:
        """Every ``every``-th commit, each rank also writes its shards to ``directory`` in DCP's
        format (``elastic.sharded.checkpoint``); a world that lost a commit with both its holders,
        or a job restarted from nothing, resumes from the newest one."""
        if every < 1:
            raise ValueError(f"durable commits: every must be >= 1, got {every}")
        checkpoint.prepare_directory(directory)
        object.__setattr__(self, "_checkpoint_dir", directory)
        object.__setattr__(self, "_checkpoint_every", every)

    def _write_durable(self, comm) -> None:
        """Every rank writes its file, then one allgather (entered once the file is on disk, or
        its write failed) tells rank 0 where every item is; rank 0 completes the commit."""
        step, own, where = self.commit_step, self._own, commit_watch.position(self)
        table = own["replicated"]["table"]
        extra = {"model." + k: v for k, v in own["replicated"]["buffers"].items()}
        extra.update({durable_format.dcp_key(k): v for k, v in own["replicated"]["scalars"].items()
                      if isinstance(v, torch.Tensor)})
        n = 2 * (len(table) + len(extra)) + 4 * (len(table) + len(extra))
        try:
            written = durable_format.write_rank(self._checkpoint_dir, step, comm.rank, table, own["shards"], extra,
                                                where)
            ok = 1
        except OSError as e:
            log.error("durable commit %d: rank %d could not write its shards to %s: %s", step, comm.rank,
                      self._checkpoint_dir, e)
            written, ok = np.zeros(n, dtype=np.int64), 0
        every = comm.allgather_equal(np.concatenate([np.array([ok], dtype=np.int64), written]))
        object.__setattr__(self, "_written", step)
        if comm.rank != 0:
            return
        if not every[:, 0].all():
            log.error("durable commit %d not completed: rank(s) %s could not write their shards", step,
                      [r for r in range(comm.size) if not every[r, 0]])
            return
        try:
            path = durable_format.finish(self._checkpoint_dir, step, comm.size, table, extra, own["replicated"],
                                         every[:, 1:], where)
            log.info("durable %s written to %s", commit_watch.describe_commit(step, self), path)
        except (OSError, TypeError) as e:
            log.error("durable commit %d could not be completed in %s: %s", step, self._checkpoint_dir, e)

    def _take_copies(self, comm, step: int, agree: Callable[[], None], clock: Optional["_Phases"] = None,
                     taken: Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = None,
                     local: Optional["_BuddyHolds"] = None) -> int:
        """Commits the live state as ``step``: own copy, buddy copy, then ``agree``. ``taken``
        is the own flat copy when the caller already holds it (a sync loaded the live shards
        from it); ``local``, after a reshard, what the buddy already holds of it. Returns the
        bytes sent to the buddy."""
        clock = clock or _Phases()
        shards, replicated = self._parts()
        self._check_committable({"attrs": replicated["attrs"], "handlers": replicated["handlers"],
                                 "optimizer": {"groups": replicated["groups"], "scalars": replicated["scalars"]}})
        gen = reshard.Generation(step, comm.world_version, comm.size)
        if taken is not None:
            flat, views = taken
        else:
            flat, views = transfer.flat_copy(shards, replicated["table"], comm.rank, comm.size, step,
                                             comm.world_version)
        own = {"flat": flat, "shards": views, "replicated": transfer.clone(replicated)}
        clock.mark("copy")
        buddy, sent = self._exchange(comm, gen, flat, views, replicated["table"], local) if comm.size > 1 else (None, 0)
        clock.mark("buddy")
        agreed = False
        try:
            agree()
            agreed = True
            clock.mark("agreement")
        except (MembershipChanged, LeftJob):
            agreed = True   # raised after the allreduce completed: the commit holds
            raise
        finally:
            if agreed:
                object.__setattr__(self, "_own", own)
                object.__setattr__(self, "_buddy", buddy)
                object.__setattr__(self, "_held", (gen, comm.rank))
                object.__setattr__(self, "_pending", None)
                object.__setattr__(self, "commit_step", step)
                lifecycle.session_now("ShardedState").record_commit(step)
            else:
                # Sent and received, not agreed: kept apart, announced at the next sync as pending.
                object.__setattr__(self, "_pending", (gen, comm.rank, own, buddy))
        return sent

    def _exchange(self, comm, gen: reshard.Generation, flat: torch.Tensor, views: Dict[str, torch.Tensor],
                  table: List[list], local: Optional["_BuddyHolds"]):
        """Sends this rank's flat shard copy to its buddy and returns the previous rank's: its
        size is bounded by, and must equal, what that rank's chunks hold (every rank computes
        every rank's layout from the same table), and it must name this commit. After a
        reshard (``local``) only the rows the buddy does not hold already travel. Returns (the
        buddy copy, the bytes sent)."""
        prev = (comm.rank - 1) % comm.size
        try:
            if local is None:
                expected, _ = transfer.flat_layout(table, prev, comm.size)
                send = flat
                got = comm.shift(flat, max_bytes=expected)
                buddy_views = transfer.check_buddy(got, table, prev, comm.size, gen.step, gen.world_version)
            else:
                # The table the new own copy was laid out by (the reshard's), so that the rows
                # planned, packed and put together are that copy's.
                t = local.table
                pieces = reshard.buddy_plan([shape[0] for _, shape, _ in t], local.old_size, local.holders, comm.size)
                send = transfer.pack_for_buddy(pieces, comm.rank, views, t, comm.size, gen.step, gen.world_version)
                received = comm.shift(send, max_bytes=transfer.buddy_sent_bytes(pieces, prev, t))
                got, buddy_views = transfer.assemble_buddy(received, pieces, prev, t, comm.size, gen.step,
                                                           gen.world_version, local.old_size, local.own, local.buddy)
        except ValueError as e:
            comm.abort(f"buddy copy from rank {prev}: {e}")
            raise BadPeerError(f"commit in world version {comm.world_version}: the buddy copy rank {prev} sent "
                               f"cannot be kept: {e}", op="commit", world_version=comm.world_version, rank=comm.rank,
                               peer=prev, kind=ErrorKind.BadPeer) from None
        return {"flat": got, "shards": buddy_views}, send.numel()

    # ------------------------------------------------------------------ a new world
    def _new_world(self) -> None:
        """``world_changed``: this world's model and optimizer built and the commit every rank
        agreed on loaded onto them, resharded (module doc), before the reset callbacks run, so
        they act on them. ``sync`` then commits that layout again. The sync's time counts from here."""
        session = lifecycle.session_now("ShardedState")
        comm = session.ring("ShardedState")
        session.start_sync_clock(self, comm)
        object.__setattr__(self, "_resharded", self._reshard(comm))

    def on_reset(self) -> None:
        resharded = self._resharded
        if resharded is not None and resharded["version"] == lifecycle.session_now("ShardedState").ring().world_version:
            super().on_reset()   # the new world's model and optimizer are there already
        else:   # resharded by sync() itself: the callbacks run there, on the new model
            object.__setattr__(self, "_reset_due", True)

    def sync_over(self, comm: Any) -> Tuple[int, int]:
        """The sharded state's part of a sync: commits the layout ``world_changed`` loaded (own
        copy, buddy copy); without one for this world (its first), builds and reshards first.
        Returns (the rank the replicated state came from, the commit step every rank holds)."""
        # From now on each new world is resharded as its ring forms.
        lifecycle.session_now("ShardedState.sync()").add_hooks(self._hooks)
        r = self._resharded
        object.__setattr__(self, "_resharded", None)
        if r is None or r["version"] != comm.world_version:
            r = self._reshard(comm)
        if self._reset_due:
            object.__setattr__(self, "_reset_due", False)
            super().on_reset()
        if r["disk"] is not None:
            object.__setattr__(self, "_written", r["disk"].step)
        sent = self._take_copies(comm, r["step"], _agreement(comm), r["clock"], taken=r["taken"], local=r["local"])
        seconds = time.monotonic() - r["started"]
        object.__setattr__(self, "last_reshard", {"from": r["from"], "moved_bytes": r["moved"],
                                                  "buddy_bytes": sent, "seconds": seconds,
                                                  "phases": r["clock"].phases})
        if r["disk"] is not None:
            log.info("world version %d: resumed from durable %s in %s (written by %d ranks) in %.3f s",
                     comm.world_version, commit_watch.describe_commit(r["disk"].step, self), r["disk"].path,
                     r["disk"].size, seconds)
        else:
            g = r["from"]
            log.info("world version %d: resumed from %s (%d-rank layout of world version %d), %d bytes moved "
                     "in %.3f s", comm.world_version, commit_watch.describe_commit(g.step, self), g.size,
                     g.world_version, r["moved"], seconds)
        return r["root"], self.commit_step

    def _reshard(self, comm) -> Dict[str, Any]:
        """Builds this world's model and optimizer and loads the agreed commit onto them; what
        the commit taken again in ``sync`` needs."""
        started = time.monotonic()
        clock = _Phases()
        holdings = transfer.agree_holdings(comm, self._held, self._pending)
        clock.mark("agree")
        decision = reshard.decide(holdings)
        disk = None
        if isinstance(decision, (reshard.Lost, reshard.Fresh)) and self._checkpoint_dir:
            disk = self._agree_durable(comm)
        if disk is not None:
            if isinstance(decision, reshard.Lost):
                log.warning("world version %d: commit %d is lost with both holders of rank(s) %s; restoring the "
                            "durable commit %d from %s", comm.world_version, decision.generation.step,
                            list(decision.missing), disk.step, disk.path)
            self._resume_from_disk(comm, disk)
            clock.mark("disk")
            return {"version": comm.world_version, "step": disk.step, "root": 0, "taken": None, "moved": 0,
                    "from": ("disk", disk.step), "disk": disk, "clock": clock, "started": started, "local": None}
        if isinstance(decision, reshard.Lost):
            raise CommitLostError(
                f"world version {comm.world_version}: commit {decision.generation.step} of the "
                f"{decision.generation.size}-rank world version {decision.generation.world_version} is lost: rank(s) "
                f"{list(decision.missing)} of that world and their buddies (the next rank of each) are all gone, "
                "and there is no durable commit to restore from (elastic.run(checkpoint_dir=...) keeps one)")
        model = self._build()
        clock.mark("build")
        initial = None
        fresh = isinstance(decision, reshard.Fresh)
        if fresh:
            if any(p.is_meta for p in model.parameters()):
                raise ValueError("ShardedState: build() made parameters on the meta device and there is no commit "
                                 "to fill them from; build the first world's model on the CPU")
            # The job's first state is rank 0's build(): its full tensors, sharded by the plan below.
            initial = {"model." + fqn: p.detach() for fqn, p in model.named_parameters()}
            gen = reshard.Generation(-1, 0, 1)
            decision = reshard.Resume(gen, (((0, reshard.OWN),),), root=0)
        self._install(model)
        clock.mark("shard")
        own, buddy = self._copies_of(decision.generation)
        if initial is not None and comm.rank == 0:
            own = {"shards": initial, "replicated": self._parts()[1]}
        replicated = comm.broadcast_object(own["replicated"] if comm.rank == decision.root else None,
                                           root_rank=decision.root, op="ShardedState sync")
        table = transfer.check_table(replicated, model, comm.rank, decision.root)
        clock.mark("replicated")
        # The new shards are assembled straight into this rank's next own copy (the commit
        # taken again in sync): the live state is loaded from it, nothing is copied twice.
        flat, views = transfer.flat_buffer(table, comm.rank, comm.size, decision.generation.step,
                                           comm.world_version)
        moved = transfer.move(comm, decision, table, own, buddy, views)
        clock.mark("move")
        self._load(table, views, replicated)
        clock.mark("load")
        # What each buddy holds already of the layout sync commits (not for a first world: only
        # rank 0 held its build()).
        local = None if fresh else _BuddyHolds(table, decision.holders, decision.generation.size, own, buddy)
        return {"version": comm.world_version, "step": decision.generation.step, "root": decision.root,
                "taken": (flat, views), "moved": moved, "from": decision.generation, "disk": None, "clock": clock,
                "started": started, "local": local}

    def _install(self, model) -> None:
        """Shards a fresh build() over this world's mesh, gives it storage where build() left it on
        the meta device (the values are loaded next) and makes its optimizer."""
        self._shard(model, transfer.world_mesh())
        if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
            model.to_empty(device="cpu")
        opt = self._make_optimizer(model.parameters()) if self._make_optimizer is not None else None
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", opt)

    def _agree_durable(self, comm) -> Optional[durable_format.Durable]:
        """The newest complete durable commit, the same on every rank (one allgather of its step)."""
        try:
            disk = durable_format.read_latest(self._checkpoint_dir)
        except (OSError, ValueError) as e:
            log.error("durable commits in %s cannot be read: %s", self._checkpoint_dir, e)
            disk = None
        steps = comm.allgather_equal(np.array([disk.step if disk is not None else -1], dtype=np.int64))[:, 0]
        if len(set(steps.tolist())) != 1:
            raise CommitLostError(f"world version {comm.world_version}: the ranks see different durable commits in "
                                  f"{self._checkpoint_dir} (steps by rank: {steps.tolist()}); checkpoint_dir must be "
                                  "one directory every worker shares")
        return disk

    def _resume_from_disk(self, comm, disk: durable_format.Durable) -> None:
        """Every rank reads its new shards straight from the durable commit's files (any world
        size wrote them) and the replicated state from its index."""
        model = self._build()
        self._install(model)
        try:
            table = transfer.check_table(disk.replicated, model, 0, 0)
            new = {}
            for key, shape, dtype in table:
                a, b = reshard.chunk_rows(shape[0], comm.size)[comm.rank]
                new[key] = disk.rows(key, shape, transfer.dtype_named(dtype), a, b)
        except (ValueError, TypeError) as e:
            raise CommitLostError(f"durable commit {disk.path} cannot be loaded into this model: {e}") from None
        self._load(table, new, disk.replicated)

    def _copies_of(self, gen: reshard.Generation):
        """This rank's own and buddy copies of ``gen`` (None where it holds none)."""
        if self._held is not None and self._held[0] == gen:
            return self._own, self._buddy
        pending = self._pending
        if pending is not None and pending[0] == gen:
            return pending[2], pending[3]
        return None, None

    def _load(self, table: List[list], new: Dict[str, torch.Tensor], replicated: Dict[str, Any]) -> None:
        DTensor, _ = transfer.dtensor_types()
        params = dict(self._params())
        with torch.no_grad():
            for key, _, _ in table:
                if key.startswith("model."):
                    transfer.local_rows(params[key[6:]], key).copy_(new[key])
            for fqn, b in self.model.named_buffers():
                if fqn not in replicated["buffers"]:
                    raise ValueError(f"ShardedState: the commit holds no buffer {fqn!r}")
                b.copy_(replicated["buffers"][fqn])
        if self.optimizer is not None:
            by_fqn = {fqn: p for fqn, p in params.items()}
            if len(replicated["groups"]) != len(self.optimizer.param_groups):
                raise ValueError(f"ShardedState: the commit has {len(replicated['groups'])} optimizer param groups, "
                                 f"this optimizer {len(self.optimizer.param_groups)}")
            for g, saved in zip(self.optimizer.param_groups, replicated["groups"]):
                if type(saved) is not dict or set(saved) != set(g):
                    raise ValueError("ShardedState: the commit's optimizer settings are not this optimizer's (names "
                                     f"{sorted(map(str, saved))[:12] if type(saved) is dict else saved!r:.80})")
                if [by_fqn.get(f) for f in saved["params"]] != g["params"]:
                    raise ValueError("ShardedState: the optimizer's param groups hold other parameters than the "
                                     "commit's")
                g.update({k: v for k, v in saved.items() if k != "params"})
            self.optimizer.state.clear()
            for key, _, _ in table:
                if key.startswith("optim."):
                    fqn, name = key[6:].rsplit(".", 1)
                    p = by_fqn[fqn]
                    # A copy: ``new`` may be a commit's own copy, which the optimizer must not update.
                    self.optimizer.state.setdefault(p, {})[name] = DTensor.from_local(
                        new[key].clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                        stride=p.stride())
            for key, v in replicated["scalars"].items():
                fqn, name = key[6:].rsplit(".", 1)
                if fqn not in by_fqn:
                    raise ValueError(f"ShardedState: the commit holds optimizer state for {fqn!r}, not a parameter")
                self.optimizer.state.setdefault(by_fqn[fqn], {})[name] = transfer.clone(v)
            self.optimizer.zero_grad(set_to_none=True)
        handlers = self._handlers()
        for k, sd in replicated["handlers"].items():
            if k in handlers:
                handlers[k].load_state_dict(sd)
        snapshot = {"attrs": replicated["attrs"]}
        self._check_attribute_names(snapshot)
        self._load_attributes(snapshot["attrs"])

    # ------------------------------------------------------------------ the whole state
    def make_last_commit_durable(self, comm: Any, wait_s: float) -> None:
        """Every rank writes the run's last commit (a collective, as every durable commit here)."""
        if self._checkpoint_dir and self.commit_step >= 0 and self._written != self.commit_step:
            self._write_durable(comm)

    def on_finish(self) -> None:
        """``elastic.run``'s function returned on every rank: gather the full model while the
        ring is still up, for ``full_state_dict()`` after the run."""
        lifecycle.session_now("ShardedState").remove_hooks(self._hooks)
        try:
            object.__setattr__(self, "_full", self.full_state_dict())
        except ElasticError as e:
            log.warning("ShardedState: could not gather the full model at the end of the run: %s", e)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole model as a plain torch state dict (full tensors on the CPU).

        Inside ``elastic.run`` a collective: every rank calls it and gets the same dict. After
        the run, the model as the function left it, gathered when it returned."""
        if lifecycle.running() is None and self._full is not None:
            return self._full
        if self.model is None:
            raise RuntimeError("ShardedState.full_state_dict(): no model yet (it is made by elastic.run)")
        comm = lifecycle.session_now("ShardedState.full_state_dict()").ring("ShardedState.full_state_dict()")
        out: Dict[str, torch.Tensor] = {fqn: transfer.gather(comm, p, fqn) for fqn, p in self._params()}
        for fqn, b in self.model.named_buffers():
            out[fqn] = b.detach().clone()
        sd = self.model.state_dict()
        return {k: out[k] for k in sd if k in out}


    def full_optimizer_state(self) -> Dict[str, Dict[str, Any]]:
        """The whole optimizer state by parameter name (full tensors; scalars as they are), a
        collective inside ``elastic.run``: every rank calls it."""
        if self.optimizer is None:
            return {}
        comm = lifecycle.session_now("ShardedState.full_optimizer_state()").ring("ShardedState.full_optimizer_state()")
        out: Dict[str, Dict[str, Any]] = {}
        for fqn, p in self._params():
            for name, v in sorted(self.optimizer.state.get(p, {}).items()):
                out.setdefault(fqn, {})[name] = transfer.gather(comm, v, fqn) if transfer.is_dtensor(v) else v
        return out


class _BuddyHolds(NamedTuple):
    """What the commit after a reshard needs to send each buddy only the rows it lacks: the
    reshard's table, who holds the resumed generation (``reshard.Resume.holders``), its size and
    this rank's copies."""
    table: List[list]
    holders: Tuple[Tuple[Tuple[int, int], ...], ...]
    old_size: int
    own: Optional[Dict[str, Any]]
    buddy: Optional[Dict[str, Any]]


class _ReshardOnNewWorld(hooks.StepHooks):
    """A sharded state's part in the step protocol: every new world's model is built and
    resharded as soon as its ring forms, so the reset callbacks that follow act on it.
    Registered by the state's first sync (a state made but never run reshards nothing)."""

    def __init__(self, state: "ShardedState") -> None:
        self._state = weakref.ref(state)

    def world_changed(self, change: hooks.WorldChange) -> None:
        state = self._state()
        if state is not None:
            state._new_world()


class _Phases:
    """Seconds spent in each named phase of a sync, in order (for ``last_reshard``)."""

    def __init__(self) -> None:
        self.phases: Dict[str, float] = {}
        self._at = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._at
        self._at = now


def _agreement(comm) -> Callable[[], None]:
    """The agreement of a commit taken in a sync: a one-word allreduce (no membership check:
    the world was just formed), which a rank completes only once every rank entered it."""
    return lambda: comm.allreduce_(np.zeros(1, dtype=np.int32), Sum)


__all__ = ["ShardedState", "CommitLostError"]
