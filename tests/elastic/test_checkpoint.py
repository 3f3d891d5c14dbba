"""Durable commits: checksummed files, the newest two kept, a corrupt or planted newest one logged
and skipped for the one before, and a checkpoint directory other users can write refused."""

from __future__ import annotations

import logging
import os
import re
import stat

import pytest
import torch

import elastic
from elastic.state import checkpoint
from elastic.runtime import collectives
from elastic.ring import serialization

from .bait import planted_pickle, planted_torch_save, prove_it_bites

def commit_file(directory, commit: int) -> str:
    """The durable commit file of ``commit`` in ``directory``, whatever training step its name shows."""
    found = [n for n in os.listdir(directory) if re.fullmatch(rf"elastic-commit-{commit:012d}(-[a-z0-9-]+)?\.ckpt", n)]
    assert len(found) == 1, (commit, sorted(os.listdir(directory)))
    return os.path.join(str(directory), found[0])



@pytest.fixture
def solo():
    """A real communicator of one rank, current for the module-level collectives."""
    comm = elastic.Communicator.form(listener=None, job_id="solo", secret=b"s", world_version=1, rank=0,
                                     peers=["127.0.0.1:1"])
    collectives.set_communicator(comm)
    yield comm
    collectives.set_communicator(None)
    comm.close()


@pytest.fixture
def ckpt(tmp_path):
    directory = tmp_path / "ckpt"
    checkpoint.prepare_directory(str(directory))
    return directory


def commits(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".ckpt"))


def state_at(step):
    return {"attrs": {"epoch": step, "w": torch.full((4,), float(step))}}


# --------------------------------------------------------------------------- the file
def test_a_written_commit_reads_back_bit_exact_and_only_its_owner_can_read_it(ckpt):
    state = {"model": torch.nn.Linear(3, 2).state_dict(), "attrs": {"step": 7, "nan": float("nan")}}
    path = checkpoint.write(str(ckpt), 7, state)
    assert os.path.basename(path) == checkpoint.file_name(7)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    step, back = checkpoint.read_file(path)
    assert step == 7 and serialization.dumps(back) == serialization.dumps(state)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".commit-")], "no temporary file left behind"


def test_the_newest_two_commits_are_kept(ckpt):
    for step in (2, 4, 6, 8):
        checkpoint.write(str(ckpt), step, state_at(step))
    assert commits(ckpt) == [checkpoint.file_name(6), checkpoint.file_name(8)]
    assert checkpoint.read_latest(str(ckpt))[0] == 8


@pytest.mark.parametrize("damage", ["truncated", "bit flip in the payload", "bit flip in the header", "empty",
                                    "extended", "step differs from name"])
def test_a_damaged_newest_commit_is_logged_and_the_one_before_is_used(ckpt, caplog, damage):
    checkpoint.write(str(ckpt), 4, state_at(4))
    newest = checkpoint.write(str(ckpt), 6, state_at(6))
    data = bytearray(open(newest, "rb").read())
    if damage == "truncated":
        data = data[:len(data) // 2]
    elif damage == "bit flip in the payload":
        data[len(data) // 2] ^= 0x10
    elif damage == "bit flip in the header":
        data[13] ^= 0x01  # the step: the checksum covers the header too
    elif damage == "empty":
        data = b""
    elif damage == "extended":
        data += b"\x00"
    else:
        os.replace(newest, ckpt / checkpoint.file_name(8))
        newest = str(ckpt / checkpoint.file_name(8))
    with open(newest, "wb") as f:
        f.write(data)
    with caplog.at_level(logging.WARNING, logger="elastic"):
        step, state, path = checkpoint.read_latest(str(ckpt))
    assert step == 4 and state["attrs"]["epoch"] == 4 and path.endswith(checkpoint.file_name(4))
    logged = caplog.text
    assert newest in logged and "cannot be used" in logged
    assert any(w in logged for w in ("truncated", "checksum", "announces", "name says")), logged
    assert os.path.exists(newest + ".corrupt") and not os.path.exists(newest), "moved aside, kept for inspection"


def test_with_no_usable_commit_the_error_names_every_file_and_nothing_is_moved(ckpt):
    for step in (4, 6):
        path = checkpoint.write(str(ckpt), step, state_at(step))
        with open(path, "r+b") as f:
            f.truncate(40)
    with pytest.raises(ValueError, match="no usable durable commit") as e:
        checkpoint.read_latest(str(ckpt))
    assert checkpoint.file_name(4) in str(e.value) and checkpoint.file_name(6) in str(e.value)
    assert commits(ckpt) == [checkpoint.file_name(4), checkpoint.file_name(6)]


def test_a_planted_pickle_as_the_newest_commit_is_not_executed_and_the_one_before_is_used(ckpt, tmp_path, caplog):
    marker = str(tmp_path / "pwned")
    checkpoint.write(str(ckpt), 4, state_at(4))
    for bait in (planted_torch_save(marker), planted_pickle(marker)):
        prove_it_bites(bait, marker)
        (ckpt / checkpoint.file_name(10 ** 6)).write_bytes(bait)
        (ckpt / "elastic-commit.pt").write_bytes(bait)  # where earlier versions kept their (pickle) commit
        with caplog.at_level(logging.WARNING, logger="elastic"):
            step, _, _ = checkpoint.read_latest(str(ckpt))
        assert step == 4
        assert not os.path.exists(marker)
        assert "not an elastic-ring durable commit" in caplog.text
        assert "elastic-commit.pt" in caplog.text and "never loaded" in caplog.text


# --------------------------------------------------------------------------- the directory
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o720, 0o702, 0o1777])
def test_a_checkpoint_directory_others_can_write_is_refused_naming_it_and_its_mode(tmp_path, mode):
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, mode)
    with pytest.raises(PermissionError) as e:
        checkpoint.prepare_directory(str(directory))
    assert str(directory) in str(e.value) and f"{mode:04o}" in str(e.value)
    with pytest.raises(PermissionError):
        elastic.ObjectState(epoch=0).enable_durable_commits(str(directory), 2)


def test_a_checkpoint_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 4321, 4321)
    with pytest.raises(PermissionError, match="is not owned by this user") as e:
        checkpoint.check_directory(str(directory))
    assert str(directory) in str(e.value) and "uid 4321" in str(e.value)


def test_a_checkpoint_directory_under_one_others_can_replace_it_in_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)  # no sticky bit: anyone may rename what is in it
    with pytest.raises(PermissionError, match="no sticky bit") as e:
        checkpoint.prepare_directory(str(parent / "ckpt"))
    assert str(parent) in str(e.value)
    os.chmod(parent, 0o1777)  # like /tmp: others can no longer rename this user's directory
    checkpoint.prepare_directory(str(parent / "ckpt"))


def test_a_new_checkpoint_directory_is_private(tmp_path):
    directory = tmp_path / "a" / "b"
    elastic.ObjectState(epoch=0).enable_durable_commits(str(directory), 2)
    assert stat.S_IMODE(os.stat(directory).st_mode) & 0o077 == 0


def test_a_checkpoint_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises((NotADirectoryError, FileExistsError)):
        checkpoint.prepare_directory(str(f))


# --------------------------------------------------------------------------- through State
def test_state_resumes_from_the_commit_before_a_truncated_newest_one_and_goes_on(solo, tmp_path, caplog):
    directory = str(tmp_path / "ckpt")
    first = elastic.ObjectState(epoch=0, w=torch.zeros(3))
    first.enable_durable_commits(directory, 2)
    for step in range(1, 6):
        first.epoch = step
        first.w += 1
        first.commit()  # commit_step 0..4; durable at 0, 2, 4
    assert first.finish_durable_commits()  # written on the writer thread
    newest = commit_file(directory, 4)
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) - 10)
    again = elastic.ObjectState(epoch=0, w=torch.zeros(3))
    again.enable_durable_commits(directory, 2)
    with caplog.at_level(logging.WARNING, logger="elastic"):
        again.sync()
    assert again.commit_step == 2 and again.epoch == 3 and torch.equal(again.w, torch.full((3,), 3.0))
    assert newest in caplog.text
    again.epoch += 1
    again.commit()  # the job goes on: commit 3, then 4 written afresh
    again.commit()
    assert again.finish_durable_commits()
    assert checkpoint.read_latest(directory)[0] == 4


def test_state_refuses_to_start_from_a_directory_whose_commits_are_all_unusable(solo, tmp_path):
    directory = tmp_path / "ckpt"
    state = elastic.ObjectState(epoch=0)
    state.enable_durable_commits(str(directory), 1)
    (directory / checkpoint.file_name(3)).write_bytes(b"junk")
    with pytest.raises(ValueError, match="no usable durable commit"):
        state.sync()
    assert state.commit_step == -1 and state.epoch == 0
