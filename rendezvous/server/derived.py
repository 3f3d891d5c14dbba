"""What a job's state keeps of itself so that an event costs the decision O(1), not O(N).

Every event asks how many workers are eligible for the next world, whether a worker is in the
world, and (after an abort) whether every member acknowledged it; counted afresh each is O(N),
so N joins or N acknowledgements would cost O(N^2). A state (decision.JobState, a frozen value)
keeps these derived values in its own __dict__, each recording what it was derived from
(compared by identity where it is used, so a stale one is never used); `replace` hands them on
to the states derived from it, and `carry` updates them in O(1) when an event changed one
worker. tests/rendezvous/test_decision.py checks them against fresh counts after random events.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

# decision.JobState and decision.Worker: named, not imported (the decision imports this module).
JobState = Worker = Any


def ack_counts(state: JobState) -> tuple[int, int]:
    """(members of the world still registered, those of them that acknowledged its abort): kept
    on the state like the eligible count, since every acknowledgement asks."""
    cached = state.__dict__.get("_acks")
    if cached is not None and all(a is b for a, b in zip(cached[:3], (state.workers, state.world,
                                                                        state.abort_acks))):
        return cached[3], cached[4]
    alive = sum(1 for m in state.world if m.worker_id in state.workers)
    acked = sum(1 for w in set(state.abort_acks) if w in state.workers and state.in_world(w))
    object.__setattr__(state, "_acks", (state.workers, state.world, state.abort_acks, alive, acked))
    return alive, acked


def blocked_hosts(state: JobState, now: Optional[float]) -> frozenset:
    return frozenset(h for h, r in state.hosts.items()
                     if r.blacklisted_until and (now is None or r.blacklisted_until > now))


def counts(state: JobState, w: Optional[Worker], blocked: frozenset) -> int:
    """1 when worker `w` (None: not registered) is eligible for the next world, else 0."""
    return int(w is not None and (state.in_world(w.worker_id) or (w.attached and w.host not in blocked)))


def eligible_count(state: JobState, now: Optional[float] = None) -> int:
    """len(eligible(state, now)) without sorting (the server asks after every event). Kept on the
    state and carried from one state to the next by decide() when only one worker changed, so
    an event costs O(1) here, not O(N) (N events would cost O(N^2))."""
    blocked = blocked_hosts(state, now)
    cached = state.__dict__.get("_eligible")
    if cached is not None and cached[0] is state.workers and cached[1] is state.world and cached[2] == blocked:
        return cached[3]
    # The same sum as counts() over every worker, with the O(N) part in C: the registered members
    # count whatever their host; only the rest (the standby, a few) are looked at one by one. A
    # host's blacklisting starting or ending recounts: 0.8 ms at 16,384 workers, not 3.7.
    workers, members = state.workers, state._world_index()
    standby = workers.keys() - members.keys()
    count = (len(workers) - len(standby)
             + sum(1 for wid in standby if workers[wid].attached and workers[wid].host not in blocked))
    object.__setattr__(state, "_eligible", (state.workers, state.world, blocked, count))
    return count


def updated(table: Mapping, changes: Mapping) -> dict:
    """A copy of `table` (the workers' table) with `changes` put in. dict.copy() clones the hash
    table in C; `{**table, ...}` and dict(table) rebuild it entry by entry once any key was ever
    deleted from it, as after the first failure (at 16,384 workers: 0.09 ms against 0.5 ms)."""
    new = table.copy() if isinstance(table, dict) else dict(table)
    new.update(changes)
    return new


def without(table: Mapping, key: str) -> dict:
    """A copy of `table` without `key` (see updated)."""
    new = table.copy() if isinstance(table, dict) else dict(table)
    del new[key]
    return new


DERIVED = ("_index", "_eligible", "_acks")   # what a state caches of itself (see carry)


def replace(obj, **changes):
    """dataclasses.replace that hands a JobState's derived values on to the new state: each records
    what it was derived from (compared by identity where it is used), so one that no longer holds
    is recomputed, and one that does (the world's index, when the world is the same) is kept."""
    new = dataclasses.replace(obj, **changes)
    for name in DERIVED:   # only a JobState has them
        if name in obj.__dict__:
            object.__setattr__(new, name, obj.__dict__[name])
    return new


def _same_blacklist(before: JobState, after: JobState, worker_id: str) -> bool:
    """No host's blacklisting differs between the states. An event about one worker changes at
    most that worker's host's record (a failure counted, a cooldown), so only that host is
    compared: a failure that leaves its host's cooldown as it was keeps the count carried,
    rather than recounting every worker (an O(N) recount per failure, ~2 ms each at 16,384)."""
    if after.hosts is before.hosts:
        return True
    w = before.workers.get(worker_id) or after.workers.get(worker_id)
    if w is None or len(after.hosts) != len(before.hosts) + (w.host not in before.hosts):
        return False
    old, new = before.hosts.get(w.host), after.hosts.get(w.host)
    return (old.blacklisted_until if old is not None else 0.0) == (new.blacklisted_until if new is not None else 0.0)


def carry(before: JobState, after: JobState, worker_id: str) -> JobState:
    """Carries `before`'s derived values (the world's index, the eligible count) over to `after`,
    a state that differs from it at most in worker `worker_id` and in fields neither depends on."""
    index = before.__dict__.get("_index")
    if index is not None and index[0] is after.world:
        object.__setattr__(after, "_index", index)
    cached = before.__dict__.get("_eligible")
    if (cached is not None and cached[0] is before.workers and cached[1] is before.world is after.world
            and _same_blacklist(before, after, worker_id)):
        blocked = cached[2]
        count = (cached[3] - counts(before, before.workers.get(worker_id), blocked)
                 + counts(after, after.workers.get(worker_id), blocked))
        object.__setattr__(after, "_eligible", (after.workers, after.world, blocked, count))
    acks = before.__dict__.get("_acks")
    if (acks is not None and acks[0] is before.workers and acks[1] is before.world is after.world
            and acks[2] is before.abort_acks):
        def alive(s: JobState) -> int:
            return int(worker_id in s.workers and s.in_world(worker_id))

        def acked(s: JobState) -> int:
            return alive(s) if worker_id in s.abort_acks else 0
        object.__setattr__(after, "_acks", (after.workers, after.world, after.abort_acks,
                                            acks[3] - alive(before) + alive(after),
                                            acks[4] - acked(before) + acked(after)))
    return after
