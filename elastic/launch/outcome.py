"""How the launcher ends after its job completed: exit 0 only when every worker it started ended
well, else 1 with one line naming those that did not. A pure function of how each local
worker ended (tests/launch/test_report.py), so the rules read in one place:

* a worker that exited 0 ended well;
* so did one that left the job gracefully (``left``: preempted, told to go), whatever its status;
* so did one this launcher stopped itself (discovery took its slot away);
* one killed by a signal while the job ran, or wedged in the abort of its device communicator
  (``procs.respawnable``), is a failure the job recovered from (respawned, or the world went on
  smaller): it is reported as a recovery, not here;
* anything else fails the launcher: a non-zero status or a signal after the job completed, or a
  worker still running when the launcher gave up waiting for it (then stopped).

The line names the first such worker with its error line, then each other one (``; also …``, at
most ``MORE_SHOWN``): after a member skipped the script's last barrier, the honest workers fail
and the error of the one after it on the ring names it (``elastic.ring.arrival``), whichever
exited first.

A worker that exits with an error while the job runs ends the launcher at once (the job stops);
that is the launcher's decision when it happens, not this one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from elastic.launch.procs import describe_exit, respawnable


@dataclasses.dataclass(frozen=True)
class WorkerEnd:
    """How one local worker (one incarnation of a slot) ended, as the launcher saw it."""

    worker_id: str
    rank: Optional[int]           # its last rank per Status, for the message
    code: Optional[int]           # exit status (Popen's: -N for signal N); None: still running
    during_job: bool = False      # it ended while the job still ran
    stopped: bool = False         # this launcher stopped it (not a failure of its own)
    left: bool = False            # it left the job gracefully: a success
    error: str = ""               # its last error line, quoted in the message (display only)


def _ended_well(end: WorkerEnd) -> bool:
    if end.left or end.stopped or end.code == 0:
        return True
    return end.code is not None and end.during_job and respawnable(end.code)


# Workers named after the first in the launcher's last line; more are counted.
MORE_SHOWN = 3


def completion_failure(ends: Sequence[WorkerEnd], job_id: str, waited_s: float) -> Optional[str]:
    """None when the launcher may exit 0 after job `job_id` completed; else the one-line reason,
    naming the workers in `ends` that did not end well, in the order they ended in.
    `waited_s`: how long the launcher waited for its workers after the job completed."""
    failed = [_failure(end, job_id, waited_s) for end in ends if not _ended_well(end)]
    if not failed:
        return None
    shown, rest = failed[1:1 + MORE_SHOWN], len(failed) - 1 - MORE_SHOWN
    return failed[0] + "".join(f"; also {f}" for f in shown) + (f"; and {rest} more" if rest > 0 else "")


def _failure(end: WorkerEnd, job_id: str, waited_s: float) -> str:
    who = f"worker {end.worker_id}" + (f" (rank {end.rank})" if end.rank is not None else "")
    if end.code is None:
        return f"{who} was still running {waited_s:g} s after job {job_id} completed (stopped)"
    when = f"while job {job_id} ran" if end.during_job else f"after job {job_id} completed"
    return f"{who} {describe_exit(end.code)} {when}" + (f": {end.error}" if end.error else "")
