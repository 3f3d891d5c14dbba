"""ElasticSampler: shards an epoch's not-yet-processed samples over the current world.

Semantics: every rank gets the same number of samples; within an epoch no
sample is skipped, and the only repeats are the padding that makes the shards equal (at
most ``size()-1`` per re-partition).

What a DistributedSampler user can rely on:
* ``len(sampler)`` is this rank's share of a whole epoch in the current world,
  ``ceil(len(dataset) / size())``, as DistributedSampler's: it does not shrink as the epoch
  goes on, so ``len(loader)`` is the epoch's batches per rank (for schedulers, progress bars,
  averages), never 0 at the end of an epoch. After a restore or a new world mid-epoch, the
  loader yields only the batches still to do (``remaining_samples()`` of them).
* An epoch is finished once every one of its samples was recorded (``record_batch``). A commit
  of a ``TorchState`` holding a sampler whose epoch is finished commits the state's ``epoch``
  attribute, when it names that epoch, as the next one (and an int ``batch`` as 0): a restore
  or a new world after the end-of-epoch ``state.commit()`` resumes at the next epoch, instead
  of entering the finished one again with no batch and running its per-epoch code twice.
  Per-epoch code (evaluation, ``scheduler.step()``) therefore goes before the end-of-epoch
  commit; a commit inside the loop right after the epoch's last batch ends the epoch too.
* Progress is what ``record_batch`` recorded: what the loader fetched is not progress (its
  workers prefetch batches that are not trained yet). A sampler committed without any
  ``record_batch`` call in its epoch logs a warning once per epoch: a restore or a new world
  starts that epoch again from its first sample.

How: the sampler holds the epoch's *remaining* indices (in epoch order) and how many samples
each rank has processed in the current partition. Every rank has processed the same count
(the shards are equal and training is in lock-step), so the processed set follows from
(remaining, partition size, count) alone, and the whole state is identical on every rank:
committing and broadcasting it is enough. On a world change the processed samples are
removed from ``remaining`` and the rest is partitioned again over the new world.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import logging
import weakref

import numpy as np

log = logging.getLogger("elastic")


MAX_PARTITION_SIZE = 1 << 20   # world sizes a state may name: partitioning allocates one slot per rank


def partition(remaining: Sequence[int], size: int) -> List[np.ndarray]:
    """Splits ``remaining`` into ``size`` equal shards, rank r taking every size-th index from r;
    pads by repeating from the start (fewer than ``size`` repeats)."""
    remaining = np.asarray(remaining, dtype=np.int64)
    if size < 1:
        raise ValueError(f"partition size must be >= 1, got {size}")
    if remaining.size == 0:
        return [remaining.copy() for _ in range(size)]
    per_rank = -(-remaining.size // size)
    padded = np.resize(remaining, per_rank * size)  # np.resize repeats from the start
    return [padded[r::size] for r in range(size)]


def processed_indices(remaining: Sequence[int], size: int, count: int) -> np.ndarray:
    """The distinct indices that ``size`` ranks have processed after ``count`` samples each."""
    shards = partition(remaining, size)
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    return np.unique(np.concatenate([s[:count] for s in shards]))


class ElasticSampler:
    """A ``torch.utils.data.Sampler`` that survives world changes mid-epoch.

    ``set_epoch(e)`` starts epoch e (same e again: no-op, keeps progress); call
    ``record_batch(batch_idx, batch_size)`` after each batch so a re-partition knows what
    was done. Put the sampler in your ``TorchState`` so it is committed and synced.
    ``num_replicas``/``rank`` default to ``elastic.size()``/``elastic.rank()``. ``len()`` is
    this rank's share of a whole epoch (see the module's docstring for the epoch semantics).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None):
        self.dataset_len = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self._fixed_size = num_replicas
        self._fixed_rank = rank
        self.epoch = -1
        self.remaining = np.empty(0, dtype=np.int64)
        self.partition_size = 1   # world size of the current partition
        self.processed = 0        # samples each rank has processed in the current partition
        self._last_batch = -1
        self._handed = 0          # indices handed to the loader this epoch (not progress: prefetching)
        self._recorded = False    # record_batch was called this epoch
        self._warned = -1         # the epoch a commit without record_batch was warned about
        self._record_listeners: List[weakref.WeakMethod] = []   # a TorchState's step tracking
        self.set_epoch(0)

    # -- world
    def _world(self):
        if self._fixed_size is not None:
            return (self._fixed_rank or 0), self._fixed_size
        from elastic.runtime.world import current_world
        world = current_world()
        if world is None:
            return 0, 1
        return world.rank, world.size

    def _repartition_if_needed(self) -> None:
        _, size = self._world()
        if size != self.partition_size:
            self.reset()

    def reset(self) -> None:
        """Removes what was processed and partitions the rest over the current world."""
        done = processed_indices(self.remaining, self.partition_size, self.processed)
        if done.size:
            self.remaining = self.remaining[~np.isin(self.remaining, done)]
        self.partition_size = self._world()[1]
        self.processed = 0
        self._last_batch = -1

    # -- epochs and progress
    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return  # idempotent: a restart of the same epoch keeps its progress
        self.epoch = epoch
        if self.shuffle:
            self.remaining = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len).astype(np.int64)
        else:
            self.remaining = np.arange(self.dataset_len, dtype=np.int64)
        self.partition_size = self._world()[1]
        self.processed = 0
        self._last_batch = -1
        self._handed, self._recorded = 0, False

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks batch ``batch_idx`` (counted from 0 since the last (re)partition) as processed."""
        self._recorded = True
        if batch_idx > self._last_batch:
            self.processed += int(batch_size)
            self._last_batch = batch_idx
        for ref in self._record_listeners:
            listener = ref()
            if listener is not None:
                listener()

    def add_record_listener(self, listener: Any) -> None:
        """Calls the bound method ``listener()`` after every ``record_batch`` (a ``TorchState``
        holding this sampler learns that a step's batch is done); held weakly."""
        self._record_listeners.append(weakref.WeakMethod(listener))

    def epoch_finished(self) -> bool:
        """Every sample of the current epoch was recorded as processed (on every rank: the
        shards are equal and the count is the same everywhere)."""
        shard = -(-len(self.remaining) // max(1, self.partition_size))
        return self.dataset_len > 0 and self.processed >= shard

    def remaining_samples(self) -> int:
        """This rank's samples of the epoch still to come in the current world (what the next
        iteration yields), unlike ``len()``, the whole epoch's share."""
        self._repartition_if_needed()
        return max(0, len(self._shard()) - self.processed)

    # -- iteration
    def _shard(self) -> np.ndarray:
        rank, size = self._world()
        if rank >= size:
            raise ValueError(f"ElasticSampler: rank {rank} outside a world of size {size}")
        return partition(self.remaining, size)[rank]

    def __iter__(self) -> Iterator[int]:
        self._repartition_if_needed()
        self._last_batch = -1  # the loader's batch indices start again at 0
        return self._hand_out(self._shard()[self.processed:].tolist())

    def _hand_out(self, indices: List[int]) -> Iterator[int]:
        for i in indices:
            self._handed += 1
            yield i

    def __len__(self) -> int:
        """This rank's share of a whole epoch in the current world, as DistributedSampler's:
        ``ceil(len(dataset) / size())``, the same from the first batch to the last."""
        _, size = self._world()
        return -(-self.dataset_len // size)

    # -- committed state
    def state_dict(self) -> Dict[str, Any]:
        if self._handed and not self._recorded and self._warned != self.epoch:
            self._warned = self.epoch
            log.warning("ElasticSampler: committing epoch %d with no record_batch() call in it: its progress is "
                        "unknown, so a restore or a new world starts epoch %d again from its first sample; call "
                        "sampler.record_batch(batch_idx, len(batch)) after each batch", self.epoch, self.epoch)
        return {"epoch": self.epoch, "remaining": self.remaining.copy(), "partition_size": self.partition_size,
                "processed": self.processed, "seed": self.seed, "shuffle": self.shuffle}

    def check_state_dict(self, sd: Any) -> None:
        """ValueError unless ``sd`` is a state this sampler can load (``TorchState`` asks before
        loading a synced state: a peer's numbers must not make it index past the dataset or
        partition over billions of ranks)."""
        if type(sd) is not dict or not {"epoch", "remaining", "partition_size", "processed"} <= set(sd):
            raise ValueError("not an ElasticSampler state (epoch, remaining, partition_size, processed)")
        for k in ("epoch", "partition_size", "processed"):
            if isinstance(sd[k], bool) or not isinstance(sd[k], (int, np.integer)):
                raise ValueError(f"ElasticSampler {k} is not an int")
        remaining = sd["remaining"]
        if type(remaining) is not np.ndarray or remaining.ndim != 1 or remaining.dtype.kind not in "iu":
            raise ValueError("ElasticSampler remaining is not a 1-D integer array")
        if remaining.size > self.dataset_len or (remaining.size and not 0 <= remaining.min() <= remaining.max()
                                                 < self.dataset_len):
            raise ValueError(f"ElasticSampler remaining holds indices outside this dataset of {self.dataset_len}")
        if sd["epoch"] < -1 or sd["processed"] < 0 or not 1 <= sd["partition_size"] <= MAX_PARTITION_SIZE:
            raise ValueError(f"ElasticSampler epoch {sd['epoch']}, processed {sd['processed']} or partition size "
                             f"{sd['partition_size']} out of range")

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.epoch = int(sd["epoch"])
        self.remaining = np.asarray(sd["remaining"], dtype=np.int64).copy()
        self.partition_size = int(sd["partition_size"])
        self.processed = int(sd["processed"])
        self.seed = sd.get("seed", self.seed)
        self.shuffle = sd.get("shuffle", self.shuffle)
        self._last_batch = -1
        self._handed, self._recorded = 0, self.processed > 0


def committed_attrs(attrs: Dict[str, Any], handlers: Dict[str, Any]) -> Dict[str, Any]:
    """The attributes a commit of a state holding ``handlers`` stores: when one of them is an
    ``ElasticSampler`` whose epoch is finished and ``epoch`` names that epoch, the next epoch
    (and ``batch`` 0), so that resuming from the commit starts there (see the module's
    docstring). A pure function of the live values; the live attributes are left alone."""
    epoch = attrs.get("epoch")
    if type(epoch) is not int:
        return attrs
    if not any(isinstance(h, ElasticSampler) and h.epoch == epoch and h.epoch_finished() for h in handlers.values()):
        return attrs
    moved = {**attrs, "epoch": epoch + 1}
    if type(attrs.get("batch")) is int:
        moved["batch"] = 0
    return moved
