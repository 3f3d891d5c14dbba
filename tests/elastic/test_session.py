"""The session as the owner of the step protocol (elastic/runtime/session.py), on a real ring of one."""

import numpy as np
import pytest

import elastic
from elastic.runtime import current, world
from elastic.runtime.hooks import StepHooks
from elastic.runtime.session import Session


class Recorded(StepHooks):
    def __init__(self):
        self.aborted = []

    def ring_aborted(self, reason):
        self.aborted.append(reason)


def ring_of_one():
    return elastic.Communicator.form(listener=None, job_id="j", secret=b"s", world_version=1, rank=0,
                                     peers=["127.0.0.1:1"])


def test_aborting_the_ring_fails_it_and_tells_every_layer_once_each():
    comm = ring_of_one()
    s = Session(comm)
    first, second = Recorded(), Recorded()
    s.add_hooks(first)
    s.add_hooks(second)
    s.add_hooks(first)   # added once, however often
    s.abort_ring("a peer failed")
    assert comm.failed and first.aborted == ["a peer failed"] and second.aborted == ["a peer failed"]
    comm.close()


def test_a_layer_that_fails_to_abort_does_not_stop_the_others():
    class Broken(StepHooks):
        def ring_aborted(self, reason):
            raise RuntimeError("device gone")

    comm = ring_of_one()
    s = Session(comm)
    after = Recorded()
    s.add_hooks(Broken())
    s.add_hooks(after)
    s.abort_ring("superseded")
    assert after.aborted == ["superseded"]
    comm.close()


def test_a_ring_installed_by_hand_is_the_process_session_and_answers_rank_and_size():
    comm = ring_of_one()
    try:
        world.use_ring(comm)
        assert isinstance(current.session(), Session) and current.session().comm is comm
        assert (elastic.rank(), elastic.size()) == (0, 1)
        assert elastic.allreduce(np.ones(3), elastic.Sum).tolist() == [1.0, 1.0, 1.0]
    finally:
        world.use_ring(None)
        comm.close()
    assert current.session() is None
    with pytest.raises(elastic.RendezvousError, match="no ring"):
        elastic.barrier()


def test_a_ring_failure_a_layer_turned_into_another_error_is_given_back_for_its_ring_only():
    comm = ring_of_one()
    s = Session(comm)
    lost = elastic.WorkerLostError("peer 1 closed", world_version=1)
    s.note_failure(lost)
    assert s.noted_failure() is lost
    s.clear_failure()
    assert s.noted_failure() is None
    comm.close()
