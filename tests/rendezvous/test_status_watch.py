"""`elastic-rendezvous status --watch`: the live table in a real terminal (tmux), one snapshot when
stdout is not a terminal, and the formatting it is made of."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

from rendezvous.client.status_client import JobEventInfo, JobStatusInfo, MemberStatusInfo, StatusInfo
from rendezvous.wire.membership import StragglerReport
from rendezvous.client.status_view import fit, format_age, format_pace, format_status, frame, safe

from .rdzv_helpers import REPO, ServerProc, child_env, unique, wait_until


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-3, "0s"), (42.9, "42s"), (60, "1m00s"), (187, "3m07s"), (3600, "1h00m"),
    (5 * 3600 + 125, "5h02m"), (86400 * 3 + 4 * 3600, "3d04h"),
])
def test_ages_are_short(seconds, text):
    assert format_age(seconds) == text


@pytest.mark.parametrize("text, shown", [
    ("w0", "w0"),
    ("\x1b[2J\x1b[Hpwned", "\\x1b[2J\\x1b[Hpwned"),
    ("a\nb\rc", "a\\nb\\rc"),
    ("\u202eevil", "\\u202eevil"),                    # a bidi override reorders the line
    ("x" * 500, "x" * 117 + "..."),
])
def test_server_text_is_escaped_and_cut(text, shown):
    assert safe(text) == shown


def _hostile_status():
    bad = "\x1b]0;title\x07\x1b[31m"
    member = MemberStatusInfo("w" + bad, "h" + bad, 0, True, 7, "r" + bad + ":1", 0, 1, 0, 1, 3.0)
    job = JobStatusInfo("j" + bad, "RUNNING", "why" + bad, 2, 1, 8, 60.0, (member,),
                        ("bh" + bad,), (JobEventInfo(1.0, "worker_evicted" + bad, 2, "w" + bad,
                                                     "d" + bad),))
    return StatusInfo("leader" + bad, (job,))


def test_nothing_the_server_sent_reaches_the_terminal_unescaped():
    out = format_status(_hostile_status(), events=10)
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[31m" in out and "recent events:" in out and "worker_evicted" in out


def test_the_pace_column_shows_each_members_score_and_names_a_straggler():
    slow = StragglerReport(world_version=2, score=2.13, slow_windows=3, named=True)
    members = (MemberStatusInfo("w0", "h", 0, True, 7, "h:1", 0, 2, 0, 1, 3.0,
                                StragglerReport(2, 0.98, 0, False)),
               MemberStatusInfo("w1", "h", 1, True, 7, "h:2", 1, 2, 0, 1, 3.0, slow),
               MemberStatusInfo("w2", "h", None, True, -1, "h:3", age_s=1.0))
    out = format_status(StatusInfo("l", (JobStatusInfo("j", "RUNNING", "", 2, 1, 8, 60.0, members),)))
    header, *rows = [line for line in out.splitlines() if line.startswith(("RANK", "0 ", "1 ", "standby"))]
    pace = header.index("PACE")
    assert [row[pace:].split("  ")[0].strip() for row in rows] == ["0.98x", "2.13x STRAGGLER", "-"]
    assert format_pace(None) == "-"


def test_a_frame_redraws_in_place_and_fits_the_terminal():
    body = "\n".join(f"line {i} " + "x" * 300 for i in range(100))
    text = frame("header", body, 80, 20)
    assert text.startswith("\x1b[H") and text.endswith("\x1b[K\x1b[J")
    lines = text[len("\x1b[H"):].split("\r\n")
    assert len(lines) == 20
    assert all(len(line.replace("\x1b[K", "").replace("\x1b[J", "")) <= 80 for line in lines)
    assert "82 more line(s)" in lines[-1]      # 101 lines, 19 shown
    assert fit("a\nb", 10, 5) == ["a", "b"]


# ------------------------------------------------------------------------- real server, processes
@pytest.fixture
def server(tmp_path):
    s = ServerProc(tmp_path, "--insecure", "--heartbeat-timeout", "2")
    yield s
    s.kill()


def _status_cmd(address, *args):
    return [sys.executable, "-m", "rendezvous", "status", "--server", address, *args]


@pytest.mark.slow
def test_watch_without_a_terminal_prints_one_snapshot_with_events_and_exits_0(server, workers):
    job = unique("job")
    ws = [workers([server.address], job, f"w{i}", host="nodeA", min_np=2) for i in range(2)]
    for w in ws:
        w.world(1)
    done = subprocess.run(_status_cmd(server.address, "--watch"), cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout                     # no redraw codes into a pipe
    assert f"job {job}  phase RUNNING  world 1" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if " nodeA " in line]
    assert sorted(r[1] for r in rows) == ["w0", "w1"] and sorted(r[0] for r in rows) == ["0", "1"]
    events = done.stdout.split("recent events:", 1)[1]
    assert "job_created" in events and "world_formed" in events and "worker_joined" in events


def test_watch_without_a_terminal_and_no_server_says_why_and_exits_1(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(_status_cmd(f"127.0.0.1:{port}", "--watch", "--timeout", "1"), cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--interval", "0"], "--interval 0.0 is outside"),
    (["--events", "-1"], "--events -1 is outside"),
    (["--events", "51"], "--events 51 is outside 0..50"),
])
def test_watch_refuses_bad_flags_with_a_clear_message(args, message):
    from rendezvous.cli import main
    with pytest.raises(SystemExit) as e:
        main(["status", "--server", "127.0.0.1:1", "--watch", *args])
    assert message in str(e.value.code)


class Tmux:
    """A detached tmux session of 200x50 running one command; its pane read as text."""

    def __init__(self, command: str):
        self.name = unique("watch")
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50",
                        command], check=True, timeout=10, env=child_env())

    def pane(self) -> str:
        done = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True,
                              text=True, timeout=10)
        return done.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True, timeout=10)

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True, timeout=10)


def _member_rows(pane: str) -> dict[str, str]:
    """worker id -> its RANK column, for the table rows of host nodeA in the pane."""
    rows = [line.split() for line in pane.splitlines() if " nodeA " in line]
    return {r[1]: r[0] for r in rows if len(r) > 2 and r[2] == "nodeA"}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_watch_in_a_terminal_follows_a_killed_worker_and_a_server_that_is_gone(tmp_path, server,
                                                                                workers):
    job = unique("job")
    ws = [workers([server.address], job, f"w{i}", host="nodeA", min_np=2) for i in range(3)]
    # min_np=2: the third worker may land in a world of its own after the first two's.
    v = max(w.world_of_size(3)["version"] for w in ws)
    # The exit status lands in the pane once the command is over.
    cmd = " ".join(_status_cmd(server.address, "--watch", "--interval", "0.2", "--timeout", "1"))
    tmux = Tmux(f"cd {REPO} && PYTHONPATH={REPO} {cmd}; echo WATCH-EXIT=$?; sleep 60")
    try:
        wait_until(lambda: set(_member_rows(tmux.pane())) == {"w0", "w1", "w2"}, 20.0,
                   "all three workers in the watched table")
        ws[1].kill(signal.SIGKILL)
        wait_until(lambda: set(_member_rows(tmux.pane())) == {"w0", "w2"}, 10.0,
                   "the killed worker gone from the table")
        # Evicted first (gone from the table), then the next world announced after the settle window.
        pane = wait_until(lambda: (p := tmux.pane()) and f"job {job}  phase RUNNING  world {v + 1}" in p
                          and p, 10.0, f"world {v + 1} in the watched table")
        assert "worker_evicted" in pane and "stream_broken" in pane      # the events below it
        assert pane.count("elastic-rendezvous status --watch") == 1      # redrawn, not appended
        server.kill()                                                    # the server is gone
        wait_until(lambda: "error: " in tmux.pane() and "retrying" in tmux.pane(), 10.0,
                   "the error line while no server answers")
        tmux.keys("C-c")
        wait_until(lambda: "WATCH-EXIT=" in tmux.pane(), 10.0, "watch to exit on Ctrl-C")
        assert "WATCH-EXIT=0" in tmux.pane()
    finally:
        tmux.kill()


def test_status_help_documents_watch(capsys):
    from rendezvous.cli import main

    with pytest.raises(SystemExit) as e:
        main(["status", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--watch", "--interval S", "--events N", "not a terminal", "Ctrl-C"):
        assert text in out, text
