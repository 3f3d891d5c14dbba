"""State.sync, commit() and broadcast_object between real worker processes on a real ring: the
most advanced rank's model, optimizer and sampler state arrive bit-exact; a hostile root's
planted pickle is never unpickled; what the format cannot carry is refused by name at commit()."""

from __future__ import annotations

import functools
import glob
import os

import numpy as np
import pytest
import torch

import elastic
from elastic import checkpoint, collectives, serialization
from tests.chaos.checks import EPOCHS, check_identical
from tests.native.harness import run_world

from .bait import planted_pickle, planted_torch_save, prove_it_bites
from .digest import bits_digest


# --------------------------------------------------------------------------- helpers
def build(seed: int, optimizer: str) -> elastic.TorchState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = elastic.ElasticSampler(list(range(40)), shuffle=True, seed=seed)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return elastic.TorchState(model=model, optimizer=opt, sampler=sampler, scheduler=sched, epoch=0,
                              losses=[], noise=np.random.default_rng(seed).standard_normal(3))


def train(state: elastic.TorchState, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        state.optimizer.zero_grad()
        loss = state.model(torch.randn(16, 8, generator=g)).pow(2).mean()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.sampler.record_batch(len(state.losses), 4)
        state.losses.append(loss.item())
        state.epoch += 1


def digest(state: elastic.TorchState) -> str:
    """SHA-256 of the whole state, bit for bit, computed without elastic.serialization."""
    return bits_digest([state.model.state_dict(), state.optimizer.state_dict(), state.sampler.state_dict(),
                        state.scheduler.state_dict(), state.epoch, state.losses, state.noise, state.commit_step])


def solo() -> elastic.Communicator:
    return elastic.Communicator.form(listener=None, job_id="solo", secret=b"s", world_version=1, rank=0,
                                     peers=["127.0.0.1:1"])


@pytest.fixture
def alone():
    """A real communicator of one rank, current for the module-level collectives."""
    comm = solo()
    collectives.set_communicator(comm)
    yield comm
    collectives.set_communicator(None)
    comm.close()


# --------------------------------------------------------------------------- sync
# Worker bodies are module-level and the workers spawned, not forked: by now this process has
# run torch's thread pools, which a forked child cannot use.
def world(n, fn, *args, timeout=120):
    return run_world(n, functools.partial(fn, *args) if args else fn, timeout=timeout, start_method="spawn")


def _sync_from_the_most_advanced(optimizer, comm):
    state = build(seed=comm.rank, optimizer=optimizer)  # every rank starts elsewhere
    before = None
    if comm.rank == 1:
        # Rank 1 trained and committed in an earlier world of its own, then joined this one.
        earlier = solo()
        collectives.set_communicator(earlier)
        for _ in range(3):
            train(state, 2, seed=7)
            state.commit()
        train(state, 1, seed=8)  # and went on past its last commit: its live state is sent
        collectives.set_communicator(None)
        earlier.close()
        before = digest(state)
    collectives.set_communicator(comm)
    state.sync()
    after = digest(state)
    train(state, 2, seed=9)  # the same data everywhere: the same bits if the state loaded fully
    return before, after, digest(state), state.commit_step


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_gives_every_rank_the_most_advanced_model_optimizer_and_sampler_state_bit_exact(optimizer):
    results = world(3, _sync_from_the_most_advanced, optimizer)
    sent = results[1][0]
    assert [r[1] for r in results] == [sent] * 3, "every rank holds rank 1's state after the sync"
    assert len({r[2] for r in results}) == 1, "and trains on from it identically"
    assert [r[3] for r in results] == [2] * 3


def _hostile_sync_root(marker, comm):
    collectives.set_communicator(comm)
    if comm.rank == 1:
        # A member that claims the highest commit and sends a planted pickle as its state.
        comm.allgather(np.array([10 ** 9], dtype=np.int64))
        payload = np.frombuffer(planted_torch_save(marker), dtype=np.uint8).copy()
        comm.broadcast_(np.array([payload.size], dtype=np.int64), root_rank=1)
        comm.broadcast_(payload, root_rank=1)
        return None
    state = build(seed=0, optimizer="sgd")
    held = digest(state)
    with pytest.raises(elastic.BadPeerError) as e:   # the root's failure: reported and evicted
        state.sync()
    return str(e.value), e.value.peer_rank, digest(state) == held, os.path.exists(marker)


def test_a_planted_pickle_sent_as_sync_state_is_not_unpickled_and_blames_the_root(tmp_path):
    marker = str(tmp_path / "pwned")
    prove_it_bites(planted_torch_save(marker), marker)
    results = world(3, _hostile_sync_root, marker)
    for message, blamed, unchanged, marked in (results[0], results[2]):
        assert "the state rank 1 sent is malformed" in message and "not elastic.serialization data" in message
        assert blamed == 1
        assert unchanged, "a refused sync loads nothing"
        assert not marked
    assert not os.path.exists(marker)


def _root_sending_well_formed_data_of_another_shape(payload, comm):
    collectives.set_communicator(comm)
    if comm.rank == 1:
        comm.allgather(np.array([10 ** 9], dtype=np.int64))
        data = np.frombuffer(payload, dtype=np.uint8).copy()
        comm.broadcast_(np.array([data.size], dtype=np.int64), root_rank=1)
        comm.broadcast_(data, root_rank=1)
        return None
    state = build(seed=0, optimizer="sgd")
    held = digest(state)
    with pytest.raises(elastic.BadPeerError) as e:
        state.sync()
    return str(e.value), e.value.peer_rank, digest(state) == held


@pytest.mark.parametrize("value", [(5, 7), (5, {"noattrs": 1}), (5, {"attrs": {}, "model": 3})],
                         ids=["not-a-dict", "no-attrs", "model-not-a-dict"])
def test_a_sync_state_of_the_wrong_shape_blames_the_root_and_loads_nothing(value):
    results = world(3, _root_sending_well_formed_data_of_another_shape, serialization.dumps(value))
    for message, blamed, unchanged in (results[0], results[2]):
        assert "the state rank 1 sent does not fit this TorchState" in message, message
        assert blamed == 1 and unchanged


def _root_with_an_attribute_it_cannot_send(comm):
    collectives.set_communicator(comm)
    state = elastic.ObjectState(epoch=0)
    state.callback = lambda: None  # set, never committed: the first sync sends the live state
    with pytest.raises((TypeError, ValueError)) as e:
        state.sync()
    return type(e.value).__name__, str(e.value)


def test_a_root_that_cannot_send_its_state_fails_every_rank_at_once_naming_the_attribute():
    results = world(3, _root_with_an_attribute_it_cannot_send)
    assert results[0][0] == "TypeError"
    assert "ObjectState attribute 'callback' of type function cannot be committed" in results[0][1]
    for kind, message in results[1:]:
        assert kind == "ValueError" and "rank 0, which holds the most advanced commit (-1), could not send" in message


# --------------------------------------------------------------------------- broadcast_object
def _hostile_broadcast_root(marker, comm):
    if comm.rank == 0:
        payload = np.frombuffer(planted_pickle(marker), dtype=np.uint8).copy()
        comm.broadcast_(np.array([payload.size], dtype=np.int64), root_rank=0)
        comm.broadcast_(payload, root_rank=0)
        return None
    with pytest.raises(elastic.BadPeerError) as e:   # the root's failure: reported and evicted under elastic.run
        comm.broadcast_object(None, root_rank=0)
    return str(e.value), e.value.peer_rank


def test_a_planted_pickle_sent_to_broadcast_object_is_not_unpickled_and_blames_the_root(tmp_path):
    marker = str(tmp_path / "pwned")
    prove_it_bites(planted_pickle(marker), marker)
    results = world(3, _hostile_broadcast_root, marker)
    for message, blamed in results[1:]:
        assert "the object rank 0 sent is malformed" in message and blamed == 0
    assert not os.path.exists(marker)


def _broadcast_what_it_cannot_carry(comm):
    obj = {"fine": [1, 2.5, torch.ones(2)], "not": {1, 2}} if comm.rank == 2 else None
    with pytest.raises(TypeError) as e:
        comm.broadcast_object(obj, root_rank=2)
    ok = comm.broadcast_object({"t": torch.arange(3), "a": np.ones(2)} if comm.rank == 2 else None, root_rank=2)
    return str(e.value), torch.equal(ok["t"], torch.arange(3)) and np.array_equal(ok["a"], np.ones(2))


def test_broadcast_object_refuses_what_it_cannot_carry_on_every_rank_without_a_hang():
    results = world(3, _broadcast_what_it_cannot_carry)
    assert "a value of type set cannot be carried" in results[2][0] and "at ['not']" in results[2][0]
    for message, _ in results[:2]:
        assert "rank 2's object cannot be carried" in message
    assert all(ok for _, ok in results), "the ring is still usable afterwards"


# --------------------------------------------------------------------------- commit
class _Handler:
    """An attribute committed through state_dict()/load_state_dict(), whose state holds a function."""

    def state_dict(self):
        return {"fn": print}

    def load_state_dict(self, sd):
        pass


@pytest.mark.parametrize("attr,value,message", [
    ("fn", lambda: 1, "ObjectState attribute 'fn' of type function cannot be committed: a value of type function"),
    ("cfg", {"opts": [1, {2, 3}]}, "ObjectState attribute 'cfg' of type dict cannot be committed: a value of type "
                                   "set cannot be carried"),
    ("gen", (i for i in range(3)), "ObjectState attribute 'gen' of type generator cannot be committed"),
])
def test_commit_refuses_an_attribute_it_cannot_carry_naming_it_and_keeps_the_last_commit(alone, attr, value, message):
    state = elastic.ObjectState(epoch=1, w=torch.ones(2))
    state.commit()
    state.epoch = 2
    state.w += 1
    setattr(state, attr, value)
    with pytest.raises(TypeError) as e:
        state.commit()
    assert message in str(e.value)
    assert state.commit_step == 0
    state.restore()
    assert state.epoch == 1 and torch.equal(state.w, torch.ones(2)), "the last commit is intact"
    setattr(state, attr, None)
    state.commit()
    assert state.commit_step == 1


def test_commit_names_a_torch_state_attribute_whose_state_dict_it_cannot_carry(alone):
    state = elastic.TorchState(model=torch.nn.Linear(2, 1), optimizer=None, epoch=0, hooks=_Handler())
    with pytest.raises(TypeError, match=r"TorchState attribute 'hooks' of type _Handler cannot be committed: its "
                                        r"state_dict\(\) holds a value of type builtin_function_or_method"):
        state.commit()


def test_replacing_a_method_of_the_state_is_not_committed_state(alone):
    state = elastic.TorchState(model=torch.nn.Linear(2, 1), optimizer=None, epoch=0)
    original = state.restore
    state.restore = lambda: original()  # wrapping a method, as tests and tools do
    state.model = torch.nn.Linear(2, 1)  # replacing the model: still committed through its state_dict()
    state.commit()
    assert "restore" not in state._snapshot["attrs"] and "model" not in state._snapshot["attrs"]


# --------------------------------------------------------------------------- real jobs
def test_a_joining_worker_receives_model_adamw_and_sampler_state_bit_exact(job_factory):
    job = job_factory(min_np=2, max_np=3, JOB_OPTIMIZER="adamw", JOB_STEP_SLEEP="0.2")
    for w in ["w0", "w1"]:
        job.start(w)
    job.wait_step(5, ["w0", "w1"])
    job.start("w2")
    workers = ["w0", "w1", "w2"]
    assert job.wait(workers) == {w: 0 for w in workers}
    check_identical([job.result(w) for w in workers])
    syncs = {}
    for w in workers:
        for e in job.events(w):
            if e["ev"] == "sync":
                syncs.setdefault(e["v"], {})[w] = e
    for version, by_worker in syncs.items():
        assert len({e["digest"] for e in by_worker.values()}) == 1, f"world {version}: ranks hold different bits"
    joined = next(v for v, by_worker in sorted(syncs.items()) if "w2" in by_worker)
    sent = {syncs[joined][w]["before_digest"] for w in ("w0", "w1")}
    assert sent == {syncs[joined]["w2"]["digest"]}, "the newcomer holds exactly what the members held"


def test_a_hostile_sync_root_in_a_real_job_is_not_obeyed(job_factory, tmp_path):
    marker = str(tmp_path / "pwned")
    bait = tmp_path / "bait.pt"
    bait.write_bytes(planted_torch_save(marker))
    prove_it_bites(bait.read_bytes(), marker)
    job = job_factory(min_np=3, max_np=3)
    job.start("w0")
    job.start("w1")
    job.start("evil", JOB_EVIL_SYNC=str(bait))
    codes = job.wait(["w0", "w1", "evil"], timeout=90)
    for w in ("w0", "w1"):
        assert codes[w] != 0
        assert "sent is malformed" in job.log(w) and "not elastic.serialization data" in job.log(w), job.log(w)
    assert not os.path.exists(marker)


def test_a_relaunch_resumes_from_the_newest_sound_commit_past_a_truncated_and_a_planted_one(job_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = job_factory(job_id="first", min_np=2, max_np=2, JOB_CHECKPOINT=ckpt, JOB_EPOCHS="1")
    for w in ("a0", "a1"):
        first.start(w)
    assert first.wait(["a0", "a1"]) == {"a0": 0, "a1": 0}
    kept = sorted(glob.glob(str(ckpt / "elastic-commit-*.ckpt")))
    assert len(kept) == checkpoint.KEEP
    older, newest = kept
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    marker = str(tmp_path / "pwned")
    prove_it_bites(planted_torch_save(marker), marker)
    (ckpt / checkpoint.file_name(10 ** 6)).write_bytes(planted_torch_save(marker))
    (ckpt / "elastic-commit.pt").write_bytes(planted_torch_save(marker))

    again = job_factory(job_id="again", min_np=2, max_np=2, JOB_CHECKPOINT=ckpt, JOB_EPOCHS=str(EPOCHS))
    for w in ("b0", "b1"):
        again.start(w)
    assert again.wait(["b0", "b1"]) == {"b0": 0, "b1": 0}
    results = [again.result(w) for w in ("b0", "b1")]
    check_identical(results)
    older_step = int(os.path.basename(older)[len("elastic-commit-"):-len(".ckpt")])
    assert [r["start_commit"] for r in results] == [older_step] * 2, "resumed from the commit before the newest"
    assert all(r["epochs"] == EPOCHS for r in results), "and the job went on to the end"
    logs = again.log("b0") + again.log("b1")
    assert newest in logs and "truncated" in logs
    assert checkpoint.file_name(10 ** 6) in logs and "not an elastic-ring durable commit" in logs
    assert not os.path.exists(marker)


def test_a_loaded_state_may_not_set_the_states_own_machinery(alone, tmp_path):
    state = elastic.ObjectState(epoch=0)
    for name in ("_checkpoint_dir", "sync", "commit_step"):
        with pytest.raises(ValueError, match=f"sets '{name}', which is not a committed attribute"):
            state.load({"attrs": {"epoch": 5, name: str(tmp_path)}})
        assert state.epoch == 0 and state._checkpoint_dir is None and callable(state.sync)
    with pytest.raises(ValueError, match="not a committed attribute"):
        elastic.TorchState(model=None, optimizer=None, restore=1)
