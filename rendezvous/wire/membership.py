"""What a job and its worlds are to both sides of the rendezvous: the limits a worker asks for
(`JobSpec`), the members of an announced world with their rank layout (`Member`), what a
worker reports of its own pace (`StragglerReport`), and what it may accuse another member of (`Blame`).

The server's decision (decision.py) keeps its state in these values and a worker's client receives
them; they live apart from the decision so that a worker loads none of the server's code.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

# What a worker asks for as max_np when it is not told (ELASTIC_MAX_NP, elastic-run --max-np):
# workers beyond it are hot spares. On the wire, 0 means "not set" (see JobSpec).
DEFAULT_MAX_NP = 1024


@dataclass(frozen=True)
class JobSpec:
    """Job-wide limits: what a worker asks for at Join, and what the first join fixes for the job.

    0 means "not set": max_np 0 is no cap beyond the server's max workers per job, and an
    elastic_timeout_s of 0 the server's default. A job's own spec (`JobState.spec`) has both set
    (`resolved`); a later join may leave them 0 and then takes the job's."""

    min_np: int = 1
    max_np: int = 0
    elastic_timeout_s: float = 0.0

    def resolved(self, max_workers: int, default_elastic_timeout_s: float) -> "JobSpec":
        """This spec with every unset limit filled in from the server's settings."""
        return JobSpec(self.min_np, self.max_np or max_workers,
                       self.elastic_timeout_s or default_elastic_timeout_s)


@dataclass(frozen=True)
class Member:
    """One member of an announced world, with its rank layout."""

    worker_id: str
    host: str
    ring_address: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    commit_step: int


@dataclass(frozen=True)
class StragglerReport:
    """A worker's verdict on its own pace in its latest commit window (elastic.runtime.straggler_detector): sent
    with its Heartbeat, shown by Status."""

    world_version: int      # the world whose windows were measured
    score: float            # its compute time over the world's median (1: typical)
    slow_windows: int       # slow windows in a row, up to the last
    named: bool             # slow for the job's number of windows: a straggler


class Blame(str, enum.Enum):
    """What a failure report accuses its suspect of, beyond breaking the reporter's ring. An
    accusation evicts only once a majority of the world's other members made one about the same
    suspect and world version (rendezvous/server/verdict.py); the wire's `ReportFailureRequest.Blame`."""

    NONE = "NONE"                      # a failure report: lost, silent or slow (probed, see verdict.py)
    UNUSABLE = "UNUSABLE"              # its ring address leads to no member of the job, or what it sent cannot be received
    IMPOSSIBLE_ROW = "IMPOSSIBLE_ROW"  # its row of a commit's membership check held values no worker writes
    FALSE_PENDING = "FALSE_PENDING"    # it claimed a membership change the server never announced
    FALSE_LEAVE = "FALSE_LEAVE"        # it said at a commit that it leaves, and did not
    DIVERGED = "DIVERGED"              # it ran another collective, or other ring settings, than the majority
    UNRECEIVABLE = "UNRECEIVABLE"      # it sent the reporter, over their link only, what cannot be received
