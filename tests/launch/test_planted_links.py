"""Every file a tool writes, with a symbolic link planted where it goes (as another user could in a
shared directory): the link's target is never written, truncated or created.

Each test plants two kinds of link: one to a file that exists ("someone else's", its content must
not change) and one to a path that does not exist (it must not appear). The tools are the real
ones: `elastic-rendezvous serve` and `elastic-run` as processes, the launcher's embedded server,
the durable-commit writer, the test etcd's log.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from elastic.state import checkpoint
from elastic.launch import embedded
from rendezvous.server.etcd_process import EtcdProcess
from tests.waiting import wait_until

from .launch_helpers import REPO

THEIRS = "someone else's file\n"


def child_env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def plant(link, target_dir, name):
    """A link at ``link`` to ``target_dir/name`` (an existing file with THEIRS when ``name`` ends
    with "-exists", else a path that must stay absent); returns the target."""
    target = target_dir / name
    if name.endswith("-exists"):
        target.write_text(THEIRS)
    link.symlink_to(target)
    return target


def untouched(target) -> bool:
    if target.name.endswith("-exists"):
        return target.read_text() == THEIRS
    return not os.path.lexists(target)


@pytest.fixture
def victims(tmp_path):
    d = tmp_path / "victims"
    d.mkdir()
    return d


def test_serve_port_file_replaces_a_planted_link_and_never_writes_through_one(tmp_path, victims):
    port_file = tmp_path / "port"
    targets = [plant(port_file, victims, "port-exists"), plant(tmp_path / "port.tmp", victims, "tmp-absent")]
    proc = subprocess.Popen([sys.executable, "-m", "rendezvous", "serve", "--insecure", "--host", "127.0.0.1",
                             "--port", "0", "--port-file", str(port_file)], cwd=REPO, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: not port_file.is_symlink() and port_file.exists(), 30, "the port file")
        assert int(port_file.read_text()) > 0
        assert stat.S_IMODE(port_file.stat().st_mode) == 0o644
        assert all(untouched(t) for t in targets), [t for t in targets if not untouched(t)]
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["serve", "elastic-run"])
@pytest.mark.parametrize("planted", ["link-exists", "link-absent", "fifo"])
def test_an_events_file_that_is_a_planted_link_or_fifo_is_refused_and_nothing_is_created(tmp_path, victims, tool,
                                                                                          planted):
    events = tmp_path / "events.jsonl"
    target = None
    if planted == "fifo":
        os.mkfifo(events)   # opened for writing, a FIFO nobody reads would block forever
    else:
        target = plant(events, victims, planted)
    if tool == "serve":
        cmd = [sys.executable, "-m", "rendezvous", "serve", "--insecure", "--port", "0", "--events", str(events)]
    else:
        cmd = [sys.executable, "-m", "elastic.launch", "--np", "1", "--events", str(events), "--",
               sys.executable, "-c", "pass"]
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    why = "it is not a regular file" if planted == "fifo" else "it is a symbolic link"
    assert f"--events {events}: cannot open for appending: {why}" in done.stderr, done.stderr
    if target is not None:
        assert untouched(target)
        assert events.is_symlink()


def test_elastic_run_events_check_creates_nothing_before_the_launcher_starts(tmp_path):
    # The flag is checked at parse time; the file is created only when the launcher runs.
    events = tmp_path / "events.jsonl"
    from elastic.launch.flags import _events_file
    assert _events_file(str(events)) == str(events)
    assert not os.path.lexists(events)


def test_the_embedded_servers_token_and_port_files_replace_planted_links(tmp_path, victims, monkeypatch):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    targets = [plant(private / "token", victims, "token-exists"), plant(private / "port", victims, "port-absent"),
               plant(private / "port.tmp", victims, "porttmp-absent")]
    monkeypatch.setattr(embedded.tempfile, "mkdtemp", lambda prefix: str(private))
    server = embedded.EmbeddedServer(port=0, elastic_timeout=10.0, log_line=lambda line: None)
    try:
        assert server.wait_ready(30).startswith(f"{embedded.EMBEDDED_HOST}:")
        token = private / "token"
        assert not token.is_symlink() and token.read_text() == server.token + "\n"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert all(untouched(t) for t in targets), [t for t in targets if not untouched(t)]
    finally:
        server.stop()


def test_a_durable_commit_replaces_a_link_planted_at_its_name(tmp_path, victims):
    directory = tmp_path / "ckpt"
    checkpoint.prepare_directory(str(directory))
    target = plant(directory / checkpoint.file_name(7), victims, "ckpt-exists")
    path = checkpoint.write(str(directory), 7, {"epoch": 3})
    assert untouched(target)
    assert not os.path.islink(path) and checkpoint.read_file(path) == (7, {"epoch": 3})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_etcd_log_is_not_written_through_a_planted_link(tmp_path, victims):
    target = plant(tmp_path / "etcd.log", victims, "log-exists")
    with pytest.raises(OSError) as e:
        EtcdProcess(str(tmp_path))
    assert e.value.errno == errno.ELOOP
    assert untouched(target)
