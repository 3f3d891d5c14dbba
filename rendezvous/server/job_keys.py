"""A job's state over many store keys, and each write as what changed since the last one.

Under `{prefix}/jobs/{job}/` the store holds:

    head                           the job's scalars, its host records, and which world and
                                   generation are current (JSON; small whatever the job's size)
    w/{worker_id}/{gen}            one registered worker's record as written by generation `gen`,
                                   or a tombstone {"gone": true}
    world/{gen}/{chunk}            the world written by generation `gen`, in rank order,
                                   WORLD_CHUNK members a key

A write (`plan`) puts only the workers whose records changed and, when the world changed, the
new world's chunks; the head's generation goes up by one. The head is the commit point: it is
written last, compare-and-swap on its revision and fenced by the leader key, and a reader
(`parse`) takes, for each worker, its newest version no newer than the head's generation, and
the world of the head's `world_gen`. When a write fits one etcd transaction (WRITE_OPS
operations, WRITE_BYTES bytes: etcd refuses more than 128 operations and 1.5 MiB a request by
default) it is one transaction. When it does not (a burst of joins, a new world of thousands),
the new versions go first in transactions of their own, which no reader sees until the head
names their generation, and the versions they supersede are deleted after it; a failover in
between leaves keys that `parse` ignores and the next write deletes. So no job size hits a
request limit, and a failure or a join costs a write of a few hundred bytes plus, when it
changes the world, ~70 bytes per member for the new rank order.

A job written by an earlier version as one value at `{prefix}/jobs/{job}` is read as before and
moved to this layout by its next write (in the same transaction that creates the head).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Optional

from rendezvous.server import job_json
from rendezvous.server.decision import JobState, Member, Worker

WORLD_CHUNK = 512          # members a world key holds (~40 KB)
WRITE_OPS = 100            # operations a transaction carries at most
WRITE_BYTES = 1 << 20      # bytes of values a transaction carries at most
_GEN_DIGITS = 12


def root(prefix: str) -> str:
    return f"{prefix}/jobs/"


def job_prefix(prefix: str, job_id: str) -> str:
    return f"{prefix}/jobs/{job_id}/"


def head_key(prefix: str, job_id: str) -> str:
    return job_prefix(prefix, job_id) + "head"


@dataclasses.dataclass
class StoredJob:
    """What the store holds of one job, as its writer needs it to write the next change."""

    revision: int = 0                     # the head's revision (0: no head yet)
    gen: int = 0
    world_gen: int = 0
    world: tuple = ()                     # the world as stored (compared by identity)
    world_keys: list = dataclasses.field(default_factory=list)
    workers: dict = dataclasses.field(default_factory=dict)   # worker id -> (Worker as stored, its key)
    garbage: list = dataclasses.field(default_factory=list)   # keys no committed state reads
    legacy_key: str = ""                  # the job's single value of an earlier layout, until moved
    legacy_revision: int = 0


@dataclasses.dataclass
class Plan:
    """One write: `staged` transactions of puts first (unseen until the head names them), then the
    head's transaction (`puts`, `deletes`, compare-and-swap on `expected`), then `after` deletes.
    `stored` is what the store holds once the head's transaction landed."""

    staged: list
    puts: dict
    deletes: list
    expected: dict
    after: list
    stored: StoredJob
    head: bytes


# ------------------------------------------------------------------------------ values
def _worker_json(w: Worker) -> bytes:
    return json.dumps(vars(w), separators=(",", ":"), sort_keys=True).encode()


def _member_row(m: Member) -> list:
    return [m.worker_id, m.host, m.ring_address, m.local_rank, m.local_size, m.cross_rank, m.cross_size,
            m.commit_step]


def _member_of(rank: int, row: list) -> Member:
    worker_id, host, ring_address, local_rank, local_size, cross_rank, cross_size, commit_step = row
    return Member(worker_id, host, ring_address, rank, local_rank, local_size, cross_rank, cross_size, commit_step)


def _head_json(state: JobState, gen: int, world_gen: int, chunks: int) -> bytes:
    d = {k: v for k, v in vars(state).items() if not k.startswith("_")}   # not the derived caches
    del d["workers"], d["world"]
    d["spec"] = vars(state.spec)
    d["phase"] = state.phase.value
    d["hosts"] = {k: vars(h) for k, h in state.hosts.items()}
    d["gen"], d["world_gen"], d["world_chunks"] = gen, world_gen, chunks
    return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()


def _gen_part(gen: int) -> str:
    return f"{gen:0{_GEN_DIGITS}d}"


# ------------------------------------------------------------------------------ writing
def plan(prefix: str, state: JobState, stored: StoredJob) -> Plan:
    """The write that takes the store from `stored` to `state`: O(what changed) keys, plus the
    world's chunks when the world changed. Finding what changed compares records by identity
    (the decision replaces what it changes), a pointer comparison per worker."""
    base = job_prefix(prefix, state.job_id)
    gen = stored.gen + 1
    new_stored = StoredJob(gen=gen, world_gen=stored.world_gen, world=stored.world,
                           world_keys=list(stored.world_keys), workers=stored.workers.copy())
    puts: dict[str, bytes] = {}
    superseded: list[str] = list(stored.garbage)
    removed: list[str] = []
    for wid, w in state.workers.items():
        old = stored.workers.get(wid)
        if old is not None and old[0] is w:
            continue
        key = f"{base}w/{wid}/{_gen_part(gen)}"
        puts[key] = _worker_json(w)
        new_stored.workers[wid] = (w, key)
        if old is not None:
            superseded.append(old[1])
    for wid in [wid for wid in stored.workers if wid not in state.workers]:
        removed.append(wid)
        superseded.append(new_stored.workers.pop(wid)[1])
    if state.world is not stored.world:
        rows = [_member_row(m) for m in state.world]
        new_stored.world, new_stored.world_gen = state.world, gen
        new_stored.world_keys = []
        for i in range(0, len(rows), WORLD_CHUNK):
            key = f"{base}world/{_gen_part(gen)}/{i // WORLD_CHUNK:06d}"
            puts[key] = json.dumps(rows[i:i + WORLD_CHUNK], separators=(",", ":")).encode()
            new_stored.world_keys.append(key)
        superseded += stored.world_keys
    head = _head_json(state, gen, new_stored.world_gen, len(new_stored.world_keys))
    expected = {base + "head": stored.revision}
    if stored.legacy_key:
        expected[stored.legacy_key] = stored.legacy_revision
        superseded.append(stored.legacy_key)
    size = sum(len(v) for v in puts.values()) + len(head)
    # A key of an uncommitted earlier attempt may be this generation's again: put, not deleted.
    superseded = [k for k in superseded if k not in puts]
    if len(puts) + len(superseded) + 1 <= WRITE_OPS and size <= WRITE_BYTES:
        return Plan([], {**puts, base + "head": head}, superseded, expected, [], new_stored, head)
    # Too big for one transaction: tombstones keep the removed workers removed across a failover
    # between the head and the deletes.
    tomb = b'{"gone":true}'
    for wid in removed:
        key = f"{base}w/{wid}/{_gen_part(gen)}"
        puts[key] = tomb
        superseded.append(key)
    staged, batch, batch_bytes = [], {}, 0
    for key, value in puts.items():
        if batch and (len(batch) >= WRITE_OPS or batch_bytes + len(value) > WRITE_BYTES):
            staged.append(batch)
            batch, batch_bytes = {}, 0
        batch[key] = value
        batch_bytes += len(value)
    if batch:
        staged.append(batch)
    legacy = [stored.legacy_key] if stored.legacy_key else []
    after = [k for k in superseded if k not in legacy]
    return Plan(staged, {base + "head": head}, legacy, expected, after, new_stored, head)


def first_write(prefix: str, state: JobState) -> Plan:
    """The write that creates a job (its first run, or a new run once the old one's keys are gone)."""
    return plan(prefix, state, StoredJob())


# ------------------------------------------------------------------------------ reading
def parse(prefix: str, listing: Mapping[str, "object"]) -> list[tuple[JobState, StoredJob]]:
    """Every job in a listing of `root(prefix)` (key -> Versioned), as its committed state and
    what its writer needs. Raises (KeyError, TypeError, ValueError) on a malformed record."""
    top = root(prefix)
    by_job: dict[str, dict[str, object]] = {}
    legacy: dict[str, object] = {}
    for key, v in listing.items():
        rest = key[len(top):]
        job_id, sep, sub = rest.partition("/")
        if not sep:
            legacy[job_id] = v
        else:
            by_job.setdefault(job_id, {})[sub] = v
    out = []
    for job_id, v in legacy.items():
        if "head" in by_job.get(job_id, {}):
            continue   # moved: the head was written in the transaction that deleted this (never both)
        state = job_json.from_json(v.value)
        out.append((state, StoredJob(world=state.world, legacy_key=top + job_id, legacy_revision=v.revision,
                                     garbage=[job_prefix(prefix, job_id) + k for k in by_job.get(job_id, {})])))
    for job_id, keys in by_job.items():
        if "head" in keys:
            out.append(_parse_job(job_prefix(prefix, job_id), keys))
    return out


def _parse_job(base: str, keys: Mapping[str, "object"]) -> tuple[JobState, StoredJob]:
    head = keys["head"]
    d = json.loads(head.value)
    gen, world_gen, chunks = d.pop("gen"), d.pop("world_gen"), d.pop("world_chunks")
    stored = StoredJob(revision=head.revision, gen=gen, world_gen=world_gen)
    newest: dict[str, tuple[int, str]] = {}
    world_parts: list[tuple[int, str]] = []
    for sub, v in keys.items():
        kind, _, rest = sub.partition("/")
        if kind == "w":
            wid, _, g = rest.rpartition("/")
            g = int(g)
            if g > gen:
                stored.garbage.append(base + sub)           # a write that never committed
            elif wid not in newest or g > newest[wid][0]:
                if wid in newest:
                    stored.garbage.append(base + newest[wid][1])
                newest[wid] = (g, sub)
            else:
                stored.garbage.append(base + sub)
        elif kind == "world":
            g, _, chunk = rest.partition("/")
            if int(g) == world_gen:
                world_parts.append((int(chunk), sub))
            else:
                stored.garbage.append(base + sub)
    workers = {}
    for wid, (_, sub) in newest.items():
        record = json.loads(keys[sub].value)
        if record.get("gone"):
            stored.garbage.append(base + sub)
            continue
        w = Worker(**job_json.step_renamed(record))
        workers[wid] = w
        stored.workers[wid] = (w, base + sub)
    world_parts.sort()
    if [c for c, _ in world_parts] != list(range(chunks)):
        raise ValueError(f"{base}: the head names {chunks} world chunk(s) of generation {world_gen}, "
                         f"the store holds {[c for c, _ in world_parts]}")
    rows = [row for _, sub in world_parts for row in json.loads(keys[sub].value)]
    world = tuple(_member_of(rank, row) for rank, row in enumerate(rows))
    stored.world, stored.world_keys = world, [base + sub for _, sub in world_parts]
    state = job_json.state_of(d, world, workers)
    return state, stored
