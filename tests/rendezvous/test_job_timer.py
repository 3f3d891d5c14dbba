"""Each job's timer (rendezvous/server/job_timer.py) with fakes for what it is given: what is due fires,
nothing else, and only while this replica leads. No server, sockets or waits."""
from __future__ import annotations

import asyncio
from dataclasses import replace

from rendezvous.server import decision as d
from rendezvous.server.job_timer import JobTimers
from rendezvous.server.liveness import Liveness

from .fakes import CONFIG, HEARTBEAT_TIMEOUT_S, job_of, running
from .rdzv_helpers import run_async


class Service:
    """What the timers are given, recorded."""

    def __init__(self, leader=True, retire_ok=True, now=100.0):
        self.leader, self.retire_ok, self.now = leader, retire_ok, now
        self.evicted, self.retired, self.applied = [], [], []

    def timers(self, retention_s=0.0) -> JobTimers:
        return JobTimers(CONFIG, retention_s=retention_s, is_leader=lambda: self.leader,
                         evict=self.evict, retire=self.retire, apply=self.apply,
                         clock=lambda: self.now)

    def evict(self, job, worker_id, reason, *, count_failure, cause):
        self.evicted.append((worker_id, reason, count_failure, cause))
        return job.seq

    async def retire(self, job, why):
        self.retired.append(why)
        return self.retire_ok

    def apply(self, job, event):
        self.applied.append(event)
        return job.seq, []


def fire(service, job, now):
    return run_async(service.timers().fire(job, now), 5.0)


def test_a_worker_that_missed_its_watch_deadline_is_evicted_not_against_its_host():
    svc, job = Service(), job_of(running())
    job.liveness.joined("a", now=10.0)
    assert fire(svc, job, 10.0 + HEARTBEAT_TIMEOUT_S) is False
    assert svc.evicted == [("a", f"did not open its watch stream within {HEARTBEAT_TIMEOUT_S:g} s "
                                 f"of joining", False, d.Departure.NO_WATCH)]
    assert not job.liveness.awaits_watch("a")


def test_a_deadline_not_yet_reached_evicts_nobody():
    svc, job = Service(), job_of(running())
    job.liveness.joined("a", now=10.0)
    fire(svc, job, 11.0)
    assert svc.evicted == [] and job.liveness.awaits_watch("a")


def test_a_worker_whose_stream_is_open_by_its_deadline_stays():
    svc, job = Service(), job_of(running())
    job.liveness.joined("a", now=10.0)
    job.streams["a"] = object()
    fire(svc, job, 20.0)
    assert svc.evicted == []


def test_a_replica_that_no_longer_leads_evicts_and_drops_nobody():
    svc = Service(leader=False)
    job = job_of(d.new_job("j", d.JobSpec(1, 4, 30.0), 0.0), Liveness.of_new_job(2.0, 0.0))
    job.liveness.joined("a", now=0.0)
    fire(svc, job, 10.0)
    assert svc.evicted == [] and svc.retired == []


def test_a_job_nobody_watched_without_a_world_is_dropped_at_its_idle_deadline():
    svc = Service()
    job = job_of(d.new_job("j", d.JobSpec(1, 4, 30.0), 0.0), Liveness.of_new_job(2.0, 0.0))
    assert fire(svc, job, 1.9) is False and svc.retired == []
    assert fire(svc, job, 2.0) is True
    assert svc.retired == ["dropped: no world and no worker watching it for 2 s"]


def test_a_drop_the_store_refused_is_tried_again_a_heartbeat_timeout_later():
    svc = Service(retire_ok=False, now=3.0)
    job = job_of(d.new_job("j", d.JobSpec(1, 4, 30.0), 0.0), Liveness.of_new_job(2.0, 0.0))
    assert fire(svc, job, 2.5) is False and len(svc.retired) == 1
    assert job.liveness.next_deadline() == 3.0 + HEARTBEAT_TIMEOUT_S


def test_a_job_with_a_world_is_not_dropped_when_its_streams_are_gone():
    svc, job = Service(), job_of(running(), Liveness.of_new_job(2.0, 0.0))
    fire(svc, job, 5.0)
    assert svc.retired == [] and job.liveness.next_deadline() is None


def test_a_settle_window_that_ended_ticks_the_decision():
    svc = Service()
    state = replace(running(now=0.0), change_first=50.0, change_last=50.0)
    job = job_of(state)
    fire(svc, job, 50.1)
    assert svc.applied == []
    fire(svc, job, 50.0 + CONFIG.settle_s)
    assert svc.applied == [d.Tick()]


def test_the_timer_wakes_at_the_earliest_deadline_of_the_decision_and_of_liveness():
    svc = Service()
    job = job_of(replace(running(), change_first=50.0, change_last=50.0))
    assert svc.timers().next_deadline(job) == 50.0 + CONFIG.settle_s
    job.liveness.joined("a", now=47.0)
    assert svc.timers().next_deadline(job) == 47.0 + HEARTBEAT_TIMEOUT_S
    assert svc.timers().next_deadline(job_of(running())) is None


def test_a_finished_job_is_forgotten_after_its_retention():
    svc = Service(now=100.0)
    state = replace(running(), phase=d.Phase.SUCCEEDED, finished_at=100.0)
    job = job_of(state)

    async def run():
        svc.timers(retention_s=0.0).start(job)
        await asyncio.wait_for(job.timer, 5.0)

    run_async(run())
    assert svc.retired == ["finished 0 s ago, forgotten"]
