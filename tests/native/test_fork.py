"""A child forked from a rank (a DataLoader's workers) does not keep the rank's ring alive after it dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import elastic

_CTX = mp.get_context("fork")


def _forking_victim(conn, hosts):
    """Forms a ring of two with the survivor, forks a child that outlives it (holding every
    descriptor it inherited), reports the child's pid and dies in the middle of allreduces."""
    listener = elastic.Listener("127.0.0.1", 0)
    conn.send(listener.address)
    survivor = conn.recv()
    comm = elastic.Communicator.form(listener=listener, job_id="fork", secret=b"f", world_version=1, rank=1,
                                     peers=[survivor, listener.address], hosts=hosts,
                                     config=elastic.CommConfig(timeout=30, form_timeout=10))
    buf = np.ones(1 << 16, dtype=np.float32)
    comm.allreduce_(buf, elastic.Sum)
    child = os.fork()   # as a DataLoader forks its workers
    if child == 0:
        time.sleep(60)
        os._exit(0)
    conn.send(child)
    for _ in range(20):
        comm.allreduce_(buf, elastic.Sum)   # the child's copies of the sockets are gone: the ring still works
    conn.send("killing")
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("hosts", [["h", "h"], ["a", "b"]], ids=["shm", "tcp"])
def test_a_killed_rank_whose_forked_child_lives_on_is_lost_at_once_not_at_the_collective_timeout(hosts):
    listener = elastic.Listener("127.0.0.1", 0)
    here, there = _CTX.Pipe()
    proc = _CTX.Process(target=_forking_victim, args=(there, hosts), daemon=True)
    proc.start()
    there.close()   # the victim's end: if it dies early, poll() sees the pipe end at once
    child = None
    try:
        assert here.poll(30), "victim did not start"
        victim = here.recv()
        here.send(listener.address)
        comm = elastic.Communicator.form(listener=listener, job_id="fork", secret=b"f", world_version=1, rank=0,
                                         peers=[listener.address, victim], hosts=hosts,
                                         config=elastic.CommConfig(timeout=30, form_timeout=10))
        assert comm.link_kinds == (("shm", "shm") if hosts[0] == hosts[1] else ("tcp", "tcp"))
        buf = np.ones(1 << 16, dtype=np.float32)
        comm.allreduce_(buf, elastic.Sum)
        assert here.poll(30)
        child = here.recv()
        for _ in range(20):
            comm.allreduce_(buf, elastic.Sum)
        assert here.poll(30) and here.recv() == "killing"
        # The collective timeout is 30 s: a child still holding the victim's sockets would keep
        # the survivor waiting that long, and it would end as a timeout, not as a lost peer.
        with pytest.raises(elastic.WorkerLostError) as info:
            for _ in range(100000):
                comm.allreduce_(buf, elastic.Sum)
        assert info.value.reason == "peer_lost", str(info.value)
        os.kill(child, 0)   # the child is alive: its copies of the sockets were let go of, not closed by its exit
        comm.close()
        os.kill(child, signal.SIGKILL)   # it holds the victim's end of multiprocessing's exit pipe too
        child = None
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        listener.close()
        here.close()
