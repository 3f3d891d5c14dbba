"""The worker metrics snapshot: what a worker sends, and what the launcher takes (pure functions)."""

from __future__ import annotations

import json

import pytest

from elastic.runtime import worker_metrics as metrics
from elastic.runtime.worker_metrics import (BUCKETS, FORMAT, MAX_SNAPSHOT_BYTES, Recorder, SnapshotRejected,
                                            parse_snapshot)

TOKENS = {"hA-0": "t0ken", "hA-1": "other"}


def good(**changes) -> dict:
    doc = json.loads(Recorder("hA-0", "t0ken").snapshot())
    doc.update(changes)
    return doc


def encode(doc) -> bytes:
    return json.dumps(doc).encode()


def test_a_fresh_recorders_snapshot_is_taken_with_its_values():
    snap = parse_snapshot(Recorder("hA-0", "t0ken").snapshot(), TOKENS)
    assert (snap.worker, snap.rank, snap.world_version, snap.committed_step, snap.steps) == ("hA-0", -1, 0, -1, 0)
    assert snap.allreduce == {}
    assert set(snap.hist) == set(BUCKETS)
    assert all(len(counts) == len(BUCKETS[k]) + 1 for k, (_, counts) in snap.hist.items())


@pytest.mark.parametrize("data, reason", [
    (b"x" * (MAX_SNAPSHOT_BYTES + 1), "oversized"),
    (b"\xff\xfe not utf-8", "not_json"),
    (b"{not json", "not_json"),
    (b'{"steps": NaN}', "not_json"),
    (b"[1, 2, 3]", "schema"),
    (b"[" * 4000 + b"]" * 4000, "not_json"),        # nested deeper than the parser goes
])
def test_bytes_that_are_not_a_snapshot_are_rejected(data, reason):
    with pytest.raises(SnapshotRejected) as e:
        parse_snapshot(data, TOKENS)
    assert e.value.reason == reason


@pytest.mark.parametrize("changes, reason, says", [
    ({"worker": "hZ-9"}, "unknown_worker", "hZ-9"),
    ({"worker": 7}, "unknown_worker", "was not started"),
    ({"token": "guess"}, "bad_token", "wrong token"),
    ({"token": "other"}, "bad_token", "wrong token"),          # another worker's token
    ({"token": "\ud800"}, "bad_token", "wrong token"),         # a lone surrogate: no codec encodes it
    ({"token": "t0ken\u00e9"}, "bad_token", "wrong token"),    # not ASCII
    ({"worker": "\udfff"}, "unknown_worker", "was not started"),
    ({"v": FORMAT + 1}, "schema", "format"),
    ({"extra": 1}, "schema", "extra"),
    ({"steps": -1}, "schema", "steps"),
    ({"steps": 1.5}, "schema", "not an integer"),
    ({"steps": True}, "schema", "not a number"),
    ({"steps": "3"}, "schema", "not a number"),
    ({"steps": 2 ** 60}, "schema", "out of range"),
    ({"rank": -2}, "schema", "rank"),
    ({"final": "yes"}, "schema", "final"),
    ({"lost_seconds": -0.5}, "schema", "lost_seconds"),
    ({"straggler_score": -1.0}, "schema", "straggler_score"),
    ({"straggler_score": "2x"}, "schema", "straggler_score"),
    ({"straggler_score": 1e300}, "schema", "straggler_score"),
    ({"allreduce": {"infiniband": [1, 1, 0.1]}}, "schema", "transports"),
    ({"allreduce": {"tcp": [1, 1]}}, "schema", "calls, bytes, seconds"),
    ({"allreduce": {"tcp": [1, -8, 0.1]}}, "schema", "bytes"),
    ({"allreduce": []}, "schema", "transports"),
    ({"hist": {}}, "schema", "hist must have"),
    ({"hist": dict(good()["hist"], step=[0.0, 1])}, "schema", "hist step"),
    ({"hist": dict(good()["hist"], sync=[-1.0] + [0] * (len(BUCKETS["sync"]) + 1))}, "schema", "hist sync sum"),
])
def test_a_snapshot_with_a_bad_field_is_rejected_naming_it(changes, reason, says):
    doc = good(**changes)
    with pytest.raises(SnapshotRejected) as e:
        parse_snapshot(encode(doc), TOKENS)
    assert e.value.reason == reason
    assert says in str(e.value)


def test_a_missing_field_is_rejected():
    doc = good()
    del doc["recoveries"]
    with pytest.raises(SnapshotRejected, match="recoveries"):
        parse_snapshot(encode(doc), TOKENS)


def test_every_reason_a_snapshot_is_rejected_for_is_counted_under_its_own_label():
    assert set(metrics.REJECT_REASONS) == {"oversized", "not_json", "schema", "unknown_worker", "bad_token", "sender",
                                          "error"}


class FakeRing:
    """What the recorder reads from a Communicator (a unit test of the recorder's arithmetic)."""

    def __init__(self, size=2, kinds=("shm", "shm"), hierarchical=False):
        self.size, self.link_kinds = size, kinds
        self.hierarchy = {"applies": hierarchical}

    def algorithm_for(self, nbytes):
        return "hierarchical" if nbytes > 100 else "ring"


def test_the_transport_is_read_from_the_rings_links_and_algorithm():
    rec = Recorder("w", "t")
    assert rec.transport(FakeRing(kinds=("tcp", "shm")), 8) == "shm"
    assert rec.transport(FakeRing(kinds=("tcp", "tcp")), 8) == "tcp"
    assert rec.transport(FakeRing(size=1, kinds=()), 8) == "local"
    mixed = FakeRing(kinds=("tcp", "shm"), hierarchical=True)
    assert rec.transport(mixed, 8) == "shm"
    assert rec.transport(mixed, 1000) == "hierarchical"


def test_a_recovery_counts_from_the_failure_to_the_next_sync_and_the_commits_rolled_back():
    rec = Recorder("w", "t")
    rec.sync_done(step=-1, started=0.0)               # the first sync: no recovery
    rec.commit_done(4, advanced=True, started=0.0, ok=True)
    rec.failure(step=4)
    rec.failure(step=4)                                # a second failure during the recovery: the same one
    rec.sync_done(step=2, started=0.0)                 # the survivors' newest commit was 2
    snap = parse_snapshot(rec.snapshot(), {"w": "t"})
    assert (snap.recoveries, snap.steps_redone, snap.steps, snap.committed_step) == (1, 2, 1, 2)
    assert sum(snap.hist["recovery"][1]) == 1 and sum(snap.hist["sync"][1]) == 2
    assert snap.lost_seconds > 0
    assert snap.restores == 2   # each failure restored the commit


def test_a_failure_that_kept_the_live_state_restores_nothing_and_loses_no_time():
    rec = Recorder("w", "t")
    rec.sync_done(step=-1, started=0.0)
    rec.commit_done(4, advanced=True, started=0.0, ok=True)
    rec.failure(step=4, kept=True)
    rec.sync_done(step=4, started=0.0)
    snap = parse_snapshot(rec.snapshot(), {"w": "t"})
    assert (snap.recoveries, snap.steps_redone, snap.restores, snap.lost_seconds) == (1, 0, 0, 0.0)


def test_the_straggler_score_is_sent_once_a_window_was_judged():
    rec = Recorder("w", "t")
    assert parse_snapshot(rec.snapshot(), {"w": "t"}).straggler_score is None
    rec.straggler_score = 2.5
    assert parse_snapshot(rec.snapshot(), {"w": "t"}).straggler_score == 2.5


def test_a_commit_that_took_no_copy_is_not_a_step():
    rec = Recorder("w", "t")
    rec.commit_done(-1, advanced=False, started=0.0, ok=False)
    snap = parse_snapshot(rec.snapshot(), {"w": "t"})
    assert snap.steps == 0 and sum(snap.hist["commit"][1]) == 0


def test_without_the_launchers_variables_nothing_is_recorded():
    assert metrics.config_from_env({}) == (None, None)
    assert metrics.start(None, None, "w") is None

    class Committed:
        commit_step = 3

    with metrics.timed(None, Committed(), "commit"):   # no recorder: nothing timed, nothing raised
        pass


@pytest.mark.parametrize("env, says", [
    ({"ELASTIC_METRICS_SOCKET": "/tmp/x.sock"}, "go together"),
    ({"ELASTIC_METRICS_SOCKET": "rel.sock", "ELASTIC_METRICS_TOKEN": "t"}, "absolute path"),
])
def test_bad_metrics_variables_are_a_clear_error(env, says):
    with pytest.raises(ValueError, match=says):
        metrics.config_from_env(env)
