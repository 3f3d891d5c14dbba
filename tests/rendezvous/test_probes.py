"""How the verdicts on a failure report are carried out (rendezvous/server/probes.py): probes sent and
answered, waits, evictions, the world formed again, the replies. Fakes stand for what it is given:
evict, send (onto a suspect's Watch), the journal's apply and wait_durable, the leader check, and
the clock. No server or sockets: a probe is answered, or a stream breaks, from the fake send. The
rules themselves are table-tested in test_verdict.py."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from rendezvous.server import decision as d
from rendezvous.server.job_record import Stream
from rendezvous.server.liveness import Liveness
from rendezvous.server.probes import FailureReports
from rendezvous.server.server_wire import RpcRefusal

from rendezvous.wire.membership import Blame
from rendezvous.wire.messages import blame_pb

from .fakes import CONFIG, HEARTBEAT_TIMEOUT_S, job_of, running
from .rdzv_helpers import run_async


class Service:
    """What the judge is given, recorded. `on_probe(job, suspect, nonce)` plays the suspect."""

    def __init__(self, job, now=500.0, step=0.0, leading_since=0.0, on_probe=None, leads=None):
        self.job, self.now, self.step = job, now, step
        self.leading_since = leading_since
        self.on_probe = on_probe
        self.leads = leads if leads is not None else (lambda: True)
        self.evicted, self.applied, self.sent, self.awaited, self.recorded = [], [], [], [], []

    def clock(self):
        # `step`: each reading is that much later (a suspect that stays silent past any deadline).
        self.now += self.step
        return self.now

    def reports(self) -> FailureReports:
        return FailureReports(HEARTBEAT_TIMEOUT_S, leading_since=lambda: self.leading_since,
                              require_leader=self.require_leader, evict=self.evict,
                              send=self.send, apply=self.apply, wait_durable=self.wait_durable,
                              record=self.record, clock=self.clock)

    async def require_leader(self):
        if not self.leads():
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, "not the leader")

    def evict(self, job, worker_id, reason, count_failure=True, cause=d.Departure.FAILED):
        self.evicted.append((worker_id, cause, count_failure))
        job.state, _ = d.decide(job.state, d.Evict(worker_id, reason, count_failure, cause), 0.0,
                                CONFIG)
        job.seq += 1
        return job.seq

    def send(self, job, worker_id, event):
        self.sent.append((worker_id, event))
        if event.WhichOneof("event") == "probe" and self.on_probe is not None:
            self.on_probe(job, worker_id, event.probe.nonce)

    def apply(self, job, event):
        self.applied.append(event)
        job.seq += 1
        return job.seq, []

    async def wait_durable(self, job, seq):
        self.awaited.append(seq)

    def record(self, state, event, **fields):
        self.recorded.append((event, fields))


def report(suspect="b", reporter="a", world_version=1, reason="connection reset", unusable=False,
           timed_out=False, blame=Blame.NONE):
    return SimpleNamespace(world_version=world_version, suspect_worker_id=suspect, reason=reason,
                           unusable_address=unusable, timed_out=timed_out, blame=blame_pb(blame)), reporter


def judge(svc, request, reporter):
    job = svc.job
    return run_async(svc.reports().judge(job, job.state.workers[reporter], request), 5.0)


def with_streams(liveness=None):
    job = job_of(running(), liveness)
    for w in job.state.workers:
        job.streams[w] = Stream()
    return job


def test_a_report_from_outside_the_world_is_refused_with_permission_denied():
    job = with_streams()
    job.state, _ = d.decide(job.state, d.Join("x", "h9", "10.0.0.9:9000"), 2.0, CONFIG)
    with pytest.raises(RpcRefusal) as e:
        judge(Service(job), *report(reporter="x"))
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_an_accusation_waits_for_the_majority_and_evicts_the_suspect_even_while_its_stream_is_open():
    svc = Service(with_streams())
    job = svc.job

    async def body():
        reports = svc.reports()
        first = asyncio.ensure_future(reports.judge(job, job.state.workers["a"], report(unusable=True)[0]))
        await asyncio.sleep(0.05)
        assert not first.done() and svc.evicted == []      # one member's word: it waits for the others
        second = await reports.judge(job, job.state.workers["c"], report(reporter="c", blame=Blame.UNUSABLE)[0])
        return await first, second

    first, second = run_async(body(), 5.0)
    assert first.evicted and second.evicted
    assert svc.evicted[0] == ("b", d.Departure.UNUSABLE_ADDRESS, True)
    assert svc.sent == []            # no probe: an answer would prove only that it lives


def test_an_accusation_no_other_member_joins_evicts_nobody_and_the_world_is_formed_again():
    # Every clock reading is past the wait for the others: nobody else accuses the suspect.
    svc = Service(with_streams(), step=10 * HEARTBEAT_TIMEOUT_S)
    answer = judge(svc, *report(blame=Blame.IMPOSSIBLE_ROW))
    assert not answer.evicted and "accused (impossible_row) by a alone" in answer.detail
    assert svc.evicted == [] and len(svc.applied) == 1 and isinstance(svc.applied[0], d.RingBroken)
    assert svc.recorded[0][1]["cause"] == "uncorroborated_accusation"


def test_bytes_only_the_receiver_saw_no_other_member_joins_evicts_both_ends():
    svc = Service(with_streams(), step=10 * HEARTBEAT_TIMEOUT_S)
    answer = judge(svc, *report(blame=Blame.UNRECEIVABLE))
    assert answer.evicted and "both evicted" in answer.detail
    assert svc.evicted == [("b", d.Departure.DISPUTED, False), ("a", d.Departure.DISPUTED, False)]


def test_a_suspect_that_lost_its_stream_under_this_leader_is_evicted_and_counted():
    job = with_streams()
    del job.streams["b"]
    svc = Service(job)
    assert judge(svc, *report()).evicted
    assert svc.evicted == [("b", d.Departure.REPORTED, True)] and svc.awaited


def answer_probe(job, suspect, nonce):
    probed, fut = job.probes[nonce]
    assert probed == suspect
    fut.set_result(suspect)


def break_stream(job, suspect, nonce):
    job.streams.pop(suspect).ended.set()


def test_a_suspect_that_answers_its_probe_stays_and_the_broken_world_is_formed_again():
    job = with_streams()
    svc = Service(job, on_probe=answer_probe)
    answer = judge(svc, *report())
    assert not answer.evicted and "answered a probe" in answer.detail
    assert svc.evicted == [] and [w for w, _ in svc.sent] == ["b"]
    assert svc.applied == [d.RingBroken("a", 1, "ring of world 1 broken, every member alive "
                                                "(reported by a: connection reset)")]
    assert job.liveness.failure_at is not None     # the recovery clock runs until the next world
    assert job.probes == {}
    assert svc.recorded == [("ring_broken", {"worker_id": "b", "world_version": 1, "reporter": "a",
                                             "cause": "broken_ring_link",
                                             "detail": "broken ring link waiting on rank 1 (b), "
                                                       "every member alive"})]


def test_a_suspect_whose_stream_breaks_while_probed_is_evicted():
    svc = Service(with_streams(), on_probe=break_stream)
    answer = judge(svc, *report())
    assert answer.evicted and svc.evicted == [("b", d.Departure.REPORTED, True)]


def test_a_silent_suspect_whose_connection_stays_alive_is_trusted_and_the_world_formed_again():
    # Every clock reading is past the probe's deadline: the suspect never answers, and keepalive
    # (its open stream) vouches for it.
    svc = Service(with_streams(), step=HEARTBEAT_TIMEOUT_S + 1)
    answer = judge(svc, *report())
    assert not answer.evicted and "stayed alive (keepalive)" in answer.detail
    assert svc.evicted == [] and len(svc.applied) == 1 and isinstance(svc.applied[0], d.RingBroken)


def test_losing_leadership_while_probing_answers_unavailable_and_forgets_the_probe():
    job = with_streams()
    svc = Service(job, leads=lambda: not job.probes)   # leads until the probe is out

    with pytest.raises(RpcRefusal) as e:
        judge(svc, *report())
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert job.probes == {} and svc.evicted == [] and svc.applied == []


def test_a_suspect_awaited_after_a_leader_change_is_probed_once_it_reattaches():
    live = Liveness.after_leader_change(HEARTBEAT_TIMEOUT_S, ["a", "b", "c"], 0.0, 7.0)
    job = with_streams(live)
    del job.streams["b"]
    svc = Service(job, now=500.0, leading_since=500.0, on_probe=answer_probe)

    def reattach():   # what the Watch handler does when b opens its stream
        job.streams["b"] = Stream()
        live.watch_opened("b")
        job.attached.set()

    async def body():
        asyncio.get_running_loop().call_soon(reattach)
        return await svc.reports().judge(job, job.state.workers["a"], report()[0])

    answer = run_async(body(), 5.0)
    assert not answer.evicted and "answered a probe" in answer.detail
    assert [w for w, _ in svc.sent] == ["b"] and svc.evicted == []
