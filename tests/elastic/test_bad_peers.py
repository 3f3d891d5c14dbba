"""A member nobody can use as a ring neighbour is evicted; the healthy workers re-form and finish.

Real server, real worker processes (tests/elastic/job.py), and one member that joins through the
rendezvous client with a ring address that passes the server's checks but leads nowhere: a
closed port, or a squatter that answers the handshake with an unauthenticated refusal saying
"forms no ..." (a settings verdict it cannot prove). Each healthy worker that meets it raises
``BadPeerError`` naming its rank, reports it as an unusable address, and the server evicts it
even though it is alive (it answers probes); nobody ends with ValueError or a settings error.
"""

from __future__ import annotations

import grpc
import pytest

from rendezvous.common.channel import RendezvousRPCError
from rendezvous.wire.membership import JobSpec
from rendezvous.client.watch_events import Ended
from rendezvous.client.worker_client import RendezvousClient
from tests.chaos.checks import EPOCHS, check_accounting, check_identical
from tests.native import wire

from .jobs import wait_until

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

FORMS_NO = b"this worker forms no leaders' ring (channel 2): is ELASTIC_ALLREDUCE_ALGORITHM the same on every worker?"


@pytest.mark.parametrize("bad", ["closed-port", "unauthenticated-forms-no"])
def test_a_member_that_cannot_be_connected_is_evicted_and_the_job_completes(job_factory, server, bad):
    # A squatter ACKs every HELLO and answers the proof with an unsigned "forms no" refusal.
    squatter = wire.FakeListener(wire.refuse_after_proof(FORMS_NO, None)) if bad == "unauthenticated-forms-no" else None
    address = squatter.address if squatter else wire.closed_port_address()
    job = job_factory(min_np=2, max_np=3, ELASTIC_FORM_TIMEOUT="5")
    # Joins first, alive all along (its client answers probes): only the reports can remove it.
    stranger = RendezvousClient([server.address], job_id="job", worker_id="bad", host="badhost",
                                ring_address=address, spec=JobSpec(min_np=2, max_np=3))
    try:
        stranger.join()
        workers = ["w0", "w1"]
        for w in workers:
            job.start(w)
        stranger.wait_world(timeout_s=60)  # it is a member of the first world
        evicted = []

        def ended():
            ev = stranger.next_event(0.1)
            if isinstance(ev, Ended):
                evicted.append(ev.reason)
            return evicted

        wait_until(ended, 90, "the server to evict the member nobody can connect to")
        assert job.wait(workers, timeout=120) == {w: 0 for w in workers}
        results = [job.result(w) for w in workers]
        check_identical(results)
        check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
        assert all(r["final_size"] == 2 for r in results)
        logs = "".join(job.log(w) for w in workers)
        says = "without proving this job's secret (not acted on)" if squatter else "nothing listens at its announced address"
        # elastic.run's recovery of a WorkerLostError: the last commit restored, or the live state kept
        assert says in logs and ("restoring commit" in logs or "keeping the live state" in logs), logs
        assert "Error" not in logs, logs  # no traceback: no ValueError, no settings verdict
        assert "unusable ring address" in evicted[0] and "reported by w" in evicted[0], evicted
        if squatter:
            assert squatter.connections >= 1 and squatter.errors == []
    finally:
        stranger.close()
        if squatter:
            squatter.close()


def test_an_unusable_address_report_evicts_only_when_a_member_of_that_world_makes_it(server):
    # Three live clients for a job of two: a standby must not evict a member by calling its
    # address unusable; a member of the world may, and the suspect goes although it is alive.
    spec = JobSpec(min_np=2, max_np=2)
    clients = {f"c{i}": RendezvousClient([server.address], job_id="pair", worker_id=f"c{i}", host=f"h{i}",
                                         ring_address=f"127.0.0.1:{4000 + i}", spec=spec) for i in range(3)}
    try:
        for c in clients.values():
            c.join()
        world = clients["c0"].wait_world(timeout_s=30)
        members = [m.worker_id for m in world.peers]
        standby = next(w for w in clients if w not in members)
        reporter, suspect = members
        with pytest.raises(RendezvousRPCError) as refused:
            clients[standby].report_failure(suspect, world.world_version, reason="r", unusable_address=True)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert clients[reporter].report_failure(suspect, world.world_version, reason="r", unusable_address=True) is True
    finally:
        for c in clients.values():
            c.close()
