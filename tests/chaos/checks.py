"""What every chaos scenario asserts about a finished job: the promise of elastic.run."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List

# Epochs of the job of tests/runtime/job.py as the chaos tests run it (its default).
EPOCHS = 3


def check_identical(results: List[dict]) -> None:
    hashes = {r["worker"]: r["hash"] for r in results}
    assert len(set(hashes.values())) == 1, f"replicas differ at the end: {hashes}"


def check_accounting(results: List[dict], max_repartitions: int) -> None:
    """Every sample of every epoch was trained on; the only repeats are the padding."""
    for r in results:
        seen, epochs = r["seen"], r["epochs"]
        assert min(seen) >= epochs, f"{r['worker']}: a sample was skipped ({min(seen)} < {epochs})"
        extra = sum(seen) - epochs * len(seen)
        assert 0 <= extra <= max_repartitions, f"{r['worker']}: {extra} repeats > padding bound {max_repartitions}"


def lost_commits(events: Dict[str, List[dict]]) -> List[str]:
    """Every (re)sync at which a commit held by a member of that world was not what everyone loaded.

    `events` maps every worker that ever ran (victims included) to its event records. A sync
    record carries the rank's commit step before the sync and the one it loaded; all ranks of
    a world must load the same, and it must be the newest any of them held.
    """
    syncs = defaultdict(list)
    for worker, evs in events.items():
        for e in evs:
            if e["ev"] == "sync":
                syncs[e["v"]].append((worker, e))
    problems = []
    for version, recs in sorted(syncs.items()):
        loaded = {e["commit"] for _, e in recs}
        newest = max(e["before"] for _, e in recs)
        if len(loaded) != 1:
            problems.append(f"world {version}: ranks loaded different commits {recs}")
        elif newest >= 0 and loaded != {newest}:
            problems.append(f"world {version}: the newest commit held was {newest}, everyone loaded {loaded.pop()}")
    return problems


def check_no_commit_lost(events: Dict[str, List[dict]]) -> None:
    assert any(e["ev"] == "sync" for evs in events.values() for e in evs), "no sync was recorded"
    problems = lost_commits(events)
    assert not problems, "\n".join(problems)


def check_loss(results: List[dict], fault_free_loss: float, tolerance: float = 1e-3) -> None:
    """Training got as far as without faults: the final loss is within `tolerance` of the
    initial loss above the fault-free run's (the job converges to ~1e-5 at every world size,
    so a lost or garbled state shows as a loss near the initial one)."""
    for r in results:
        assert r["loss"] <= fault_free_loss + tolerance * r["initial_loss"], (
            f"{r['worker']}: final loss {r['loss']:.3g} vs fault-free {fault_free_loss:.3g} "
            f"(initial {r['initial_loss']:.3g})")


def check_outcome(job, survivors: Iterable[str], *, fault_free_loss: float, max_repartitions: int,
                  codes: Dict[str, int] | None = None) -> List[dict]:
    """The job completed on `survivors`, and everything the promise says holds."""
    survivors = list(survivors)
    if codes is None:
        codes = job.wait(survivors)
    assert codes == {w: 0 for w in survivors}, {w: (c, job.log(w)[-1500:]) for w, c in codes.items() if c}
    results = [job.result(w) for w in survivors]
    check_identical(results)
    check_accounting(results, max_repartitions)
    check_no_commit_lost({w: job.events(w) for w in job.procs})
    check_loss(results, fault_free_loss)
    return results
