"""Rings formed from views, as workers of a job form them: each rank knows only the ranks its rings
connect to and the digest of the world (the rendezvous server's views, through the client's
conversion), never the full list. Every ring kind forms and computes; a rank told another world
under the same version is refused by its neighbours' handshake."""
from __future__ import annotations

import numpy as np
import pytest

import elastic
from elastic.ring.ring_view import RingView
from rendezvous.client.worker_client import _world
from rendezvous.server.world_views import WorldViews
from rendezvous.wire.membership import Member

from .harness import HIERARCHICAL, World, WorkerFailed, mixed_hosts, run_world


def members_of(addresses, hosts) -> tuple:
    """The members a rendezvous server would announce for these addresses and hosts (contiguous)."""
    hosts = hosts or [f"host-{r}" for r in range(len(addresses))]
    firsts = [r for r in range(len(hosts)) if r == 0 or hosts[r] != hosts[r - 1]]
    out = []
    for r, a in enumerate(addresses):
        first = max(f for f in firsts if f <= r)
        size = hosts.count(hosts[r])
        out.append(Member(f"w{r}", hosts[r], a, r, r - first, size, 0, 1, -1))
    return tuple(out)


def server_view(rank, addresses, hosts) -> RingView:
    """What rank `rank` is told by the server: its World message, read by the worker's client."""
    views = WorldViews(5, members_of(addresses, hosts))
    return RingView.of_world(_world(views.world(views.members[rank])))


def other_world_view(rank, addresses, hosts) -> RingView:
    """Rank 1 is told a world in which rank 0 has another worker id: same version, size and ranks."""
    members = members_of(addresses, hosts)
    if rank == 1:
        members = (Member("impostor", *[getattr(members[0], f) for f in
                                        ("host", "ring_address", "rank", "local_rank", "local_size", "cross_rank",
                                         "cross_size", "commit_step")]),) + members[1:]
    views = WorldViews(5, members)
    return RingView.of_world(_world(views.world(views.members[rank])))


def _allreduce(comm):
    buf = np.full(300_000, comm.rank + 1, dtype=np.float32)   # large: the hierarchical path where it applies
    comm.allreduce_(buf, elastic.Sum)
    return float(buf[0]), comm.hierarchy["applies"]


@pytest.mark.slow
@pytest.mark.parametrize("hosts,config,hierarchical", [
    (mixed_hosts(1, 1, 1, 1, 1), None, False),                  # flat: one worker a host
    (mixed_hosts(5), None, False),                              # one host: shared memory
    (mixed_hosts(2, 2, 2), HIERARCHICAL, True),                 # hierarchical
    (mixed_hosts(3, 1, 2, 1), HIERARCHICAL, True),              # mixed hosts, leaders of single hosts
], ids=["flat", "one-host", "hierarchical", "mixed"])
def test_every_ring_kind_forms_from_views(hosts, config, hierarchical):
    n = len(hosts)
    got = run_world(n, _allreduce, transport=hosts, config=config, view_of=server_view)
    assert {r[0] for r in got} == {n * (n + 1) / 2}
    assert all(r[1] is hierarchical for r in got)


def test_a_view_of_another_world_is_refused_by_the_handshake():
    config = elastic.CommConfig(form_timeout=5, timeout=10)
    with World(3, _allreduce, transport=mixed_hosts(1, 1, 1), config=config, view_of=other_world_view) as w:
        with pytest.raises(WorkerFailed) as failed:
            w.results(60)
    assert "world digest mismatch at world version 1" in str(failed.value), failed.value
