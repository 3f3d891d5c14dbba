"""What every chaos scenario asserts about a finished job: the promise of elastic.run."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List

# Epochs of the job of tests/elastic/job.py as the chaos tests run it (its default).
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
    """Every (re)sync at which the ranks did not all load the newest commit a member of that
    world held.

    `events` maps every worker that ever ran (victims included) to its event records. A sync
    record carries the commit the rank held before (number and the training step it was taken
    at), the step of its live state then (the commit's after a restore; a later one when it
    kept its live state after a failure) and what it loaded. All ranks of a world must load
    the same; when any member held a commit, every member holding the newest one must hold it
    at the same step (a rank that restored another state under that commit number, or lost it,
    shows as a step that does not match), and what they load must be the most advanced live
    state of those members: nothing a member kept is lost.
    """
    syncs = defaultdict(list)
    for worker, evs in events.items():
        for e in evs:
            if e["ev"] == "sync":
                syncs[e["v"]].append((worker, e))
    problems = []
    for version, recs in sorted(syncs.items()):
        loaded = {(e["commit"], e["step"]) for _, e in recs}
        newest = max(e["before"] for _, e in recs)
        held_at = {e["before_step"] for _, e in recs if e["before"] == newest}
        if len(loaded) != 1:
            problems.append(f"world {version}: ranks loaded different commits (number, step) {sorted(loaded)}")
        elif newest < 0:
            continue  # nobody held a commit: rank 0's state or the durable one
        elif len(held_at) != 1:
            problems.append(f"world {version}: members held commit {newest} at different steps {sorted(held_at)}")
        else:
            # A state kept live past the commit is adopted as the commit after it.
            at = held_at.pop()
            live = max(e.get("before_live", at) for _, e in recs if e["before"] == newest)
            expected = (newest, at) if live == at else (newest + 1, live)
            if loaded != {expected}:
                problems.append(f"world {version}: the newest commit held was {newest} at step {at}, the most "
                                f"advanced live state at step {live}; everyone loaded {loaded.pop()}, not {expected}")
    return problems


def check_no_commit_lost(events: Dict[str, List[dict]]) -> None:
    assert any(e["ev"] == "sync" for evs in events.values() for e in evs), "no sync was recorded"
    problems = lost_commits(events)
    assert not problems, "\n".join(problems)


def check_loss(results: List[dict], fault_free_loss: float) -> None:
    """Training got as far as without faults. The job converges at every world size it runs at
    (to 1e-8..3e-5 in 3 epochs; the fault-free run with 3 workers: about 1e-6), while losing
    even the first half of training leaves about 4e-3: allow 100x the fault-free loss, plus
    1e-7 of the initial loss for a fault-free run that reached exactly 0."""
    for r in results:
        bound = 100 * fault_free_loss + 1e-7 * r["initial_loss"]
        assert r["loss"] <= bound, (f"{r['worker']}: final loss {r['loss']:.3g} > {bound:.3g} (fault-free "
                                    f"{fault_free_loss:.3g}, initial {r['initial_loss']:.3g})")


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
