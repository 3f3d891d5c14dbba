"""A job's state as one JSON value: `to_json(state) -> bytes` and `from_json(bytes) -> state`.

The decision's state is a plain value (decision.py). Servers before the many-keys layout stored
it whole, as one value; job_keys.py now spreads it over keys and reads such a value back (and
`state_of` builds a state from the scalars of either), so a restarted server or another replica
reads back exactly what was decided. The format is read back as written
by earlier versions of the server too (fields added since take their defaults, fields renamed
since their old names), so a server restarted into a new version changes no world.
"""
from __future__ import annotations

import json

from rendezvous.server.decision import HostRecord, JobSpec, JobState, Member, Phase, Worker


def to_json(state: JobState) -> bytes:
    """Serialize for the store (all times are wall-clock seconds, meaningful across replicas)."""
    # vars() instead of dataclasses.asdict: asdict deep-copies, which dominated at 1,024 workers.
    d = {k: v for k, v in vars(state).items() if not k.startswith("_")}   # not the derived caches
    d["spec"] = vars(state.spec)
    d["phase"] = state.phase.value
    d["world"] = [vars(m) for m in state.world]
    d["workers"] = {k: vars(w) for k, w in state.workers.items()}
    d["hosts"] = {k: vars(h) for k, h in state.hosts.items()}
    return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()


def from_json(data: bytes) -> JobState:
    """The state `to_json` stored, also as stored before `world_version` and `commit_step` had
    these names (`version`, `committed_step`). Raises (KeyError, TypeError, ValueError) on a
    malformed one."""
    d = json.loads(data)
    return state_of(d, tuple(Member(**step_renamed(m)) for m in d["world"]),
                    {k: Worker(**step_renamed(v)) for k, v in d["workers"].items()})


def state_of(d: dict, world: tuple, workers: dict) -> JobState:
    """A job's state from its stored scalars `d` (to_json's, or job_keys' head), world and workers."""
    world_version = d["world_version"] if "world_version" in d else d["version"]
    return JobState(
        job_id=d["job_id"], spec=JobSpec(**d["spec"]), created_at=d["created_at"],
        phase=Phase(d["phase"]), world_version=world_version, world=world,
        aborted_version=d["aborted_version"],
        pending_version=d.get("pending_version", 0), abort_acks=tuple(d.get("abort_acks", ())),
        workers=workers,
        hosts={k: HostRecord(**v) for k, v in d["hosts"].items()},
        change_first=d["change_first"], change_last=d["change_last"],
        below_min_since=d["below_min_since"], next_seq=d["next_seq"], reason=d["reason"],
        finished_at=d.get("finished_at"), credential=d.get("credential", ""),
        ring_secret=d.get("ring_secret", ""), run=d.get("run", ""))


def step_renamed(record: dict) -> dict:
    return {"commit_step" if k == "committed_step" else k: v for k, v in record.items()}
