"""Durable commits of a sharded state: every rank writes its own shards in
``torch.distributed.checkpoint``'s (DCP) format, so ``dcp.load`` reads them into any world
size outside elastic-ring, and a job restarted from disk reshards from them.

One directory per durable commit, ``sharded-<step>/``:

| file | written by | what |
| --- | --- | --- |
| ``__<rank>_0.distcp`` | every rank | its shards, one ``torch.save`` item each, as DCP's FileSystemWriter writes them |
| ``.metadata`` | rank 0 | DCP's index (a pickle of ``dcp.Metadata``: every rank's chunks and their offsets) |
| ``elastic-commit-<step>.ckpt`` | rank 0, last | our own index in ``elastic.state.checkpoint``'s format (checksummed, no pickle): the table of tensors, each item's file, offset, length and SHA-256, and the replicated state (attributes, buffers, optimizer settings and scalars) |

Keys are DCP's flattened names of ``{"model": model_state, "optim": {"state": …}}``:
``model.<param>``, ``model.<buffer>``, ``optim.state.<param>.<name>``.

Our own reading path never unpickles: it reads ``elastic-commit-<step>.ckpt`` (which exists only
once every rank's file and ``.metadata`` are complete: rank 0 writes it after an allgather that
each rank enters after its file is on disk), and takes a tensor's bytes out of its ``torch.save``
item with ``zipfile`` (the item's ``data/0`` member holds the raw storage; its ``data.pkl`` is
never read), checking length and SHA-256 against the index. ``.metadata`` is only for ``dcp.load``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import pickle
import re
import shutil
import zipfile
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from elastic.state import checkpoint
from elastic.sharded import reshard

log = logging.getLogger("elastic")

KEEP = 2   # durable commits kept
_DIR = re.compile(r"sharded-(\d{1,19})(?:-[a-z0-9-]{1,80})?")


def dir_name(step: int, position: str = "") -> str:
    """The directory of durable commit ``step``, named with the training step it holds
    (``sharded-000000000006-step-60``; ``position`` as ``elastic.runtime.commit_watch`` gives it)."""
    return checkpoint.file_name(step, position).replace("elastic-commit-", "sharded-", 1)[:-len(".ckpt")]


def dcp_key(key: str) -> str:
    """Our table key (``model.<fqn>`` / ``optim.<fqn>.<name>``) as DCP's flattened name."""
    return key if key.startswith("model.") else "optim.state." + key[len("optim."):]


def _item_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().contiguous().clone(), buf)   # a clone: the item holds exactly these rows
    return buf.getvalue()


def write_rank(directory: str, step: int, rank: int, table: List[list], shards: Dict[str, torch.Tensor],
               extra: Dict[str, torch.Tensor], position: str = "") -> np.ndarray:
    """Writes this rank's file of durable commit ``step``; returns its (offset, length) per table
    entry then per ``extra`` key (-1 where it holds no rows), as an int64 array, and the SHA-256
    of each item (32 bytes each) after them."""
    path = os.path.join(directory, dir_name(step, position))
    os.makedirs(path, mode=0o700, exist_ok=True)
    out = np.full(2 * (len(table) + len(extra)), -1, dtype=np.int64)
    digests = bytearray(32 * (len(table) + len(extra)))
    items = [(i, shards[key]) for i, (key, _, _) in enumerate(table) if shards[key].shape[0] > 0]
    items += [(len(table) + j, t) for j, t in enumerate(extra.values())]
    tmp = os.path.join(path, f".__{rank}_0.distcp.tmp")
    with open(tmp, "wb") as f:
        for i, t in items:
            data = _item_bytes(t)
            out[2 * i], out[2 * i + 1] = f.tell(), len(data)
            digests[32 * i:32 * i + 32] = hashlib.sha256(data).digest()
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, f"__{rank}_0.distcp"))
    return np.concatenate([out, np.frombuffer(bytes(digests), dtype=np.int64)])


def finish(directory: str, step: int, size: int, table: List[list], extra: Dict[str, torch.Tensor],
           replicated: Dict[str, Any], written: np.ndarray, position: str = "") -> str:
    """Rank 0, once every rank's file is written (``written``: every rank's ``write_rank``
    answer, stacked): DCP's ``.metadata``, then our index, which makes the commit complete."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)
    path = os.path.join(directory, dir_name(step, position))
    n_items = len(table) + len(extra)
    md: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    planner: Dict[str, Tuple[str, ...]] = {}
    index: List[list] = []
    for i, (key, shape, dtype) in enumerate(table):
        name = dcp_key(key)
        chunks = []
        for r, (a, b) in enumerate(reshard.chunk_rows(shape[0], size)):
            if b <= a:
                continue
            offsets = torch.Size([a] + [0] * (len(shape) - 1))
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([b - a, *shape[1:]])))
            off, length = int(written[r][2 * i]), int(written[r][2 * i + 1])
            storage[MetadataIndex(name, offsets)] = _StorageInfo(f"__{r}_0.distcp", off, length)
            index.append([key, r, a, b, off, length, written[r][2 * n_items:].tobytes()[32 * i:32 * i + 32]])
        md[name] = TensorStorageMetadata(properties=TensorProperties(dtype=getattr(torch, dtype.split(".")[-1])),
                                         size=torch.Size(shape), chunks=chunks)
        planner[name] = tuple(name.split(".", 1)) if key.startswith("model.") else \
            ("optim", "state", *key[len("optim."):].rsplit(".", 1))
    for j, (name, t) in enumerate(extra.items()):
        i = len(table) + j
        offsets = torch.Size([0] * t.dim())
        md[name] = TensorStorageMetadata(properties=TensorProperties(dtype=t.dtype), size=t.shape,
                                         chunks=[ChunkStorageMetadata(offsets=offsets, sizes=t.shape)])
        storage[MetadataIndex(name, offsets)] = _StorageInfo("__0_0.distcp", int(written[0][2 * i]),
                                                             int(written[0][2 * i + 1]))
    meta = Metadata(state_dict_metadata=md, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=path), version=CURRENT_DCP_VERSION)
    tmp = os.path.join(path, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(meta, f)   # written for dcp.load; never read back by elastic-ring
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, ".metadata"))
    checkpoint.write(path, step, {"size": size, "table": table, "index": index, "replicated": replicated})
    for _, old in _commits(directory)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def _commits(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of the durable sharded commits in ``directory``, newest first."""
    return checkpoint.numbered(directory, _DIR)


class Durable:
    """A complete durable commit, read through our own index (never ``.metadata``)."""

    def __init__(self, path: str, step: int, value: Any):
        self.path, self.step = path, step
        if type(value) is not dict or not {"size", "table", "index", "replicated"} <= set(value):
            raise ValueError("not a sharded durable commit index")
        self.size, self.table, self.replicated = value["size"], value["table"], value["replicated"]
        if type(self.size) is not int or not 1 <= self.size <= (1 << 20) or type(self.table) is not list:
            raise ValueError("its world size or table is malformed")
        self.items: Dict[Tuple[str, int], Tuple[int, int, int, int, bytes]] = {}
        for entry in value["index"]:
            key, r, a, b, off, length, digest = entry
            self.items[(key, r)] = (a, b, off, length, digest)

    def rows(self, key: str, shape: List[int], dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``key``, read from the ranks' files that hold them."""
        per_row = math.prod(shape[1:])
        out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
        for r, (a, b) in enumerate(reshard.chunk_rows(shape[0], self.size)):
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi:
                continue
            got = self.items.get((key, r))
            if got is None or got[:2] != (a, b):
                raise ValueError(f"durable commit {self.path}: no rows {a}..{b} of {key!r} from rank {r}")
            data = self._item(r, got[2], got[3], got[4], (b - a) * per_row * out.element_size())
            chunk = torch.frombuffer(bytearray(data), dtype=dtype).view(b - a, *shape[1:]) if b > a else None
            out[lo - start:hi - start] = chunk[lo - a:hi - a]
        return out

    def _item(self, rank: int, offset: int, length: int, digest: bytes, nbytes: int) -> bytes:
        if not 0 <= offset or not 0 < length <= (1 << 40):
            raise ValueError(f"durable commit {self.path}: item at {offset}+{length} out of range")
        with open(os.path.join(self.path, f"__{rank}_0.distcp"), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length or hashlib.sha256(data).digest() != digest:
            raise ValueError(f"durable commit {self.path}: rank {rank}'s item at offset {offset} is truncated or "
                             "corrupt (checksum mismatch)")
        # A torch.save item is a zip archive; its raw storage is the member <archive>/data/0.
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/data/0")]
            if len(names) != 1 or z.getinfo(names[0]).file_size != nbytes:
                raise ValueError(f"durable commit {self.path}: rank {rank}'s item at offset {offset} does not hold "
                                 f"{nbytes} bytes of raw tensor data")
            return z.read(names[0])


def read_latest(directory: str) -> Optional[Durable]:
    """The newest complete durable commit in ``directory`` (an unreadable one is logged and the
    one before taken), or None."""
    if not os.path.isdir(directory):
        return None
    checkpoint.check_directory(directory)
    for step, path in _commits(directory):
        try:
            got, value = checkpoint.read_file(os.path.join(path, checkpoint.file_name(step)), expected_step=step)
            return Durable(path, got, value)
        except FileNotFoundError:
            log.info("durable commit %s is incomplete (no index): skipped", path)
        except (OSError, ValueError, TypeError) as e:
            log.error("durable commit %s cannot be used: %s; trying the one before", path, e)
    return None
