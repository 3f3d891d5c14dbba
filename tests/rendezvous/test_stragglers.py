"""Stragglers at the rendezvous, end to end on loopback (memory store and a real etcd): a worker's
pace reported with ReportProgress, shown by Status, named once in the events; the spares a slow
worker is told of; a straggler's leave that is clean and cools its host down."""
from __future__ import annotations

import math

import grpc
import pytest

from rendezvous.common.channel import RendezvousRPCError
from rendezvous.wire.membership import JobSpec, StragglerReport
from rendezvous.client.status_client import StatusClient
from rendezvous.client.watch_events import Abort, Pending, WorldInfo

from .rdzv_helpers import next_of, unique, wait_until, wait_world_of


def test_a_stragglers_report_is_shown_named_once_and_its_leave_cools_its_host_down(serve, client):
    s = serve(blacklist_after=3, cooldown_min_s=30.0, cooldown_max_s=60.0)
    job = unique("job")
    spec = JobSpec(min_np=2, max_np=3)
    cs = [client(s.address, w, job_id=job, host=h, spec=spec)
          for w, h in (("w0", "ha"), ("w1", "ha"), ("w2", "hb"), ("spare", "hc"))]
    for c in cs:
        c.join()
    world = wait_world_of(cs[:3], 3)[0]
    v = world.world_version
    fast, slow = cs[0], cs[1]
    with StatusClient([s.address]) as status:
        wait_until(lambda: sum(m.attached for m in status.job(job).members) == 4, 10, "the spare to attach")

        # A worker that is not slow learns of no spares (counting them costs a pass over the job).
        fast.report_progress(straggler=StragglerReport(v, 0.97, 0, False))
        assert fast.spares == 0
        # A slow one is told of the spare on another host: it may leave without the job dropping
        # below min-np. Workers of its own host are no spares: that host cools down as it leaves.
        slow.report_progress(straggler=StragglerReport(v, 2.1, 1, False))
        assert slow.spares == 1
        slow.report_progress(straggler=StragglerReport(v, 2.2, 3, True))
        slow.report_progress(straggler=StragglerReport(v, 2.3, 4, True))      # still one, named once
        fast.report_progress(straggler=StragglerReport(v - 1, 9.0, 9, True))   # about an older world: dropped

        view = status.job(job, events=50)
        paces = {m.worker_id: m.straggler for m in view.members}
        assert paces["w1"] == StragglerReport(v, pytest.approx(2.3), 4, True)
        assert paces["w0"] == StragglerReport(v, pytest.approx(0.97), 0, False)
        assert paces["w2"] is None and paces["spare"] is None
        named = [e for e in view.events if e.event == "straggler_detected"]
        assert [(e.worker_id, e.world_version) for e in named] == [("w1", v)]
        assert "2.20x the median compute for 3 windows" in named[0].detail
        assert named[0].numbers == {"rank": 1.0, "factor": 2.2, "windows": 3.0}   # typed, for tools that act

        with pytest.raises(RendezvousRPCError) as e:
            slow.report_progress(straggler=StragglerReport(v, math.nan, 1, False))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "straggler.score" in str(e.value)

        slow.leave(straggler=True)
        pending = next_of(fast, (Pending, Abort), timeout_s=10.0)
        assert isinstance(pending, Pending)                          # a clean change, not an abort
        nxt = next_of(fast, WorldInfo, timeout_s=10.0)
        assert [m.worker_id for m in nxt.peers] == ["w0", "w2", "spare"]   # the spare took its place
        view = status.job(job, events=50)
        assert view.blacklisted_hosts == ("ha",)
        assert ("straggler_left", "w1") in [(e.event, e.worker_id) for e in view.events]
        assert all(m.straggler is None for m in view.members)        # a new world: no verdict yet
        # Nothing more joins from the slow host while it cools down.
        late = client(s.address, "w1-r1", job_id=job, host="ha", spec=spec)
        with pytest.raises(RendezvousRPCError) as e:
            late.join(timeout_s=5.0)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "straggler" in str(e.value)
