"""`elastic-rendezvous status` finds this user's elastic-run jobs on this machine (rendezvous/common/local_jobs.py)."""

import json
import os

import pytest

from rendezvous.common import local_jobs
from rendezvous.common.local_jobs import LocalJob

GOOD = {"job_id": "default", "server": "127.0.0.1:41234", "token_file": "/tmp/elastic-run-x/token", "pid": 4321}


@pytest.mark.parametrize("doc, says", [
    ({**GOOD, "job_id": ""}, "a field is out of range"),
    ({**GOOD, "server": "127.0.0.1"}, "a field is out of range"),          # no port
    ({**GOOD, "token_file": "relative/token"}, "a field is out of range"),
    ({**GOOD, "pid": True}, "a field is out of range"),
    ({**GOOD, "pid": -1}, "a field is out of range"),
    ({**GOOD, "extra": 1}, "not a job file"),
    ({k: v for k, v in GOOD.items() if k != "pid"}, "not a job file"),
    ([1, 2], "not a job file"),
])
def test_a_job_file_with_a_field_out_of_range_is_refused_saying_so(doc, says):
    with pytest.raises(ValueError, match=says):
        local_jobs.parse(json.dumps(doc).encode())


def test_a_job_file_that_is_not_json_or_too_long_is_refused():
    with pytest.raises(ValueError, match="not JSON"):
        local_jobs.parse(b"\xff{")
    with pytest.raises(ValueError, match="over 4096 bytes"):
        local_jobs.parse(b" " * 5000)


def test_the_directory_is_the_users_runtime_directory_or_one_of_its_own_in_tmp():
    assert local_jobs.directory({"XDG_RUNTIME_DIR": "/run/user/7"}, 7) == "/run/user/7/elastic-ring/jobs"
    assert local_jobs.directory({}, 7) == "/tmp/elastic-ring-7/jobs"
    assert local_jobs.directory({"XDG_RUNTIME_DIR": "relative"}, 7) == "/tmp/elastic-ring-7/jobs"


def test_an_announced_job_is_found_while_its_launcher_lives_and_gone_once_withdrawn(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    path = local_jobs.announce(LocalJob("j", "127.0.0.1:5", "/t/token", os.getpid()), env)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    assert local_jobs.found(env) == ([LocalJob("j", "127.0.0.1:5", "/t/token", os.getpid())], [])
    assert local_jobs.found(env, alive=lambda pid: False) == ([], [])   # its launcher is gone
    local_jobs.withdraw(path)
    assert local_jobs.found(env) == ([], [])


def test_a_planted_link_or_a_foreign_file_is_passed_over_with_the_reason(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    path = local_jobs.announce(LocalJob("j", "127.0.0.1:5", "/t/token", os.getpid()), env)
    where = os.path.dirname(path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**GOOD, "pid": os.getpid()}))
    os.symlink(elsewhere, os.path.join(where, "planted.json"))
    jobs, skipped = local_jobs.found(env)
    assert [j.job_id for j in jobs] == ["j"]
    assert len(skipped) == 1 and "planted.json" in skipped[0]


def test_a_directory_others_may_write_is_not_read(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    path = local_jobs.announce(LocalJob("j", "127.0.0.1:5", "/t/token", os.getpid()), env)
    os.chmod(os.path.dirname(path), 0o777)
    jobs, skipped = local_jobs.found(env)
    assert jobs == [] and skipped == [f"{os.path.dirname(path)}: writable by others: not read"]
    with pytest.raises(OSError, match="writable by others"):
        local_jobs.announce(LocalJob("k", "127.0.0.1:6", "/t/token", os.getpid()), env)
