"""elastic-run --preload: workers forked from a server that imported the modules once (real launcher, real kills)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from elastic.launch.flags import UsageError, parse
from elastic.launch.environment import fork_server_env
from elastic.launch.forkserver import ForkServer, ForkServerError, Target, check_request, forkable

from .launch_helpers import wait_until


def last_line(p) -> str:
    return p.stderr[-1] if p.stderr else ""


# ---------------------------------------------------------------------------------------------- pure
@pytest.fixture
def interpreters(tmp_path):
    """A bin directory with python and python3 (a link to it), and another environment's python
    that links to the same file: (bin, which) where ``which`` finds names in bin."""
    bin_dir, other = tmp_path / "bin", tmp_path / "other"
    bin_dir.mkdir()
    other.mkdir()
    (bin_dir / "python").write_text("")
    (bin_dir / "python3").symlink_to(bin_dir / "python")
    (other / "python").symlink_to(bin_dir / "python")
    (bin_dir / "bash").write_text("")

    def which(name):
        path = name if os.path.isabs(name) else str(bin_dir / name)
        return path if os.path.lexists(path) else None
    return bin_dir, which


@pytest.mark.parametrize("command, expected", [
    (["python", "train.py", "--lr", "1"], Target("path", "train.py", ("--lr", "1"))),
    (["python", "-u", "train.py"], Target("path", "train.py", (), unbuffered=True)),
    (["python", "-m", "pkg.train", "x"], Target("module", "pkg.train", ("x",))),
    (["python3", "train.py"], Target("path", "train.py", ())),           # the same interpreter by another name
    (["python", "-c", "print(1)"], None),                                 # not a script: started as before
    (["python", "-O", "train.py"], None),                                 # a flag the fork cannot apply
    (["python", "-m", "-x"], None),
    (["python", "-m"], None),
    (["python", "-u"], None),
    (["python"], None),
    (["OTHER/python", "train.py"], None),                                 # another environment's Python
    (["bash", "run.sh"], None),
    (["missing", "train.py"], None),
])
def test_forkable_runs_this_interpreters_scripts_and_modules_only(interpreters, command, expected):
    bin_dir, which = interpreters
    command = [c.replace("OTHER", str(bin_dir.parent / "other")) for c in command]
    assert forkable(command, executable=str(bin_dir / "python"), which=which) == expected


@pytest.mark.parametrize("msg, fds, why", [
    ({"seq": 1, "argv": [sys.executable, "w.py"], "env": {"A": "1"}, "cwd": "/"}, [3], "expected 2 descriptors"),
    ([sys.executable, "w.py"], [3, 4], "expected an object"),
    ({"seq": 1, "argv": [sys.executable, "w.py"], "env": {}, "cwd": "/", "shell": "rm"}, [3, 4], "expected an object"),
    ({"seq": 1, "argv": [], "env": {}, "cwd": "/"}, [3, 4], "argv must be"),
    ({"seq": 1, "argv": [sys.executable, 7], "env": {}, "cwd": "/"}, [3, 4], "argv must be"),
    ({"seq": 1, "argv": [sys.executable, "w.py"], "env": {"A=B": "1"}, "cwd": "/"}, [3, 4], "env must map"),
    ({"seq": 1, "argv": [sys.executable, "w.py"], "env": {"A": 1}, "cwd": "/"}, [3, 4], "env must map"),
    ({"seq": 1, "argv": [sys.executable, "w.py"], "env": {}, "cwd": "tmp"}, [3, 4], "cwd must be an absolute path"),
    ({"seq": 1, "argv": ["/bin/sh", "-c", "id"], "env": {}, "cwd": "/"}, [3, 4], "not a command this interpreter runs"),
    ({"seq": 1, "argv": [sys.executable, "w.py"], "env": {"A": "1"}, "cwd": "/"}, [3, 4], None),
])
def test_the_server_refuses_a_request_of_any_other_shape(msg, fds, why):
    got = check_request(msg, fds)
    assert (got is None) if why is None else (got is not None and got.startswith(why)), got


@pytest.mark.parametrize("args, error", [
    (["--preload", "torch,,numpy", "--", sys.executable, "w.py"], "give module names separated by commas"),
    (["--preload", "os;rm", "--", sys.executable, "w.py"], "give module names separated by commas"),
    (["--preload", "torch", "--", "sh", "-c", "true"], "--preload needs a worker command this Python"),
    (["--preload", "torch", "--", sys.executable, "-c", "pass"], "--preload needs a worker command this Python"),
])
def test_bad_preload_flags_are_one_line_errors(args, error):
    with pytest.raises(UsageError, match=re.escape(error)):
        parse(["--np", "1", *args], env={})


def test_the_fork_servers_environment_holds_nothing_per_worker_nor_any_credential():
    cfg = parse(["--np", "2", "--preload", "torch", "--", sys.executable, "w.py"], env={})
    base = {"PATH": "/usr/bin", "ELASTIC_TOKEN": "secret", "ELASTIC_TOKEN_FILE": "/t", "RANK": "3",
            "LOCAL_RANK": "1", "ELASTIC_MIN_NP": "2", "ELASTIC_TLS_KEY": "/k"}
    env = fork_server_env(base, cfg)
    assert env["PATH"] == "/usr/bin" and env["OMP_NUM_THREADS"] == "1" and env["GRPC_VERBOSITY"] == "ERROR"
    assert not {"ELASTIC_TOKEN", "ELASTIC_TOKEN_FILE", "RANK", "LOCAL_RANK", "ELASTIC_MIN_NP",
                "ELASTIC_TLS_KEY"} & set(env), env


def test_preload_parses_module_names():
    assert parse(["--np", "1", "--preload", "torch, numpy.linalg", "--", sys.executable, "w.py"],
                 env={}).preload == ("torch", "numpy.linalg")
    assert parse(["--np", "1", "--", sys.executable, "w.py"], env={}).preload == ()


# ---------------------------------------------------------------------------------------------- real server
PROBE = """
import atexit, os, sys, threading, time
print("argv", sys.argv, "path0", sys.path[0], "name", __name__, "file", __file__, flush=True)
print("globals", sorted(globals()), "loader", type(__loader__).__name__, "spec", __spec__ is None, flush=True)
print("fds", sorted(int(f) for f in os.listdir("/proc/self/fd") if int(f) > 2 and os.path.exists(f"/proc/self/fd/{f}")))
atexit.register(lambda: print("atexit ran", flush=True))
mode = os.environ["MODE"]
if mode == "exit-text":
    sys.exit("bye")
if mode == "exit-7":
    sys.exit(7)
if mode == "raise":
    raise ValueError("boom")
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
if mode == "file":
    f = open(os.environ["OUT"], "w")
    f.write("an unflushed tail")   # never closed: the interpreter's exit writes it

    def holder():   # a cycle (function -> globals -> function): only a collection finalises f
        return f
if mode == "numpy":
    import numpy
    print("draw", numpy.random.randint(1 << 30), flush=True)
"""


@pytest.fixture
def server(tmp_path):
    s = ForkServer(["json", "numpy.random"], dict(os.environ), command=[sys.executable, str(tmp_path / "probe.py")])
    s.wait_ready(60)
    yield s
    s.close()


def run_both(server, command, env, out_dir):
    """(returncode, stdout, stderr) of ``command`` as a new process and as forked by ``server``
    (their OUT: plain.txt and forked.txt in ``out_dir``)."""
    plain = subprocess.run(command, env={**env, "OUT": str(out_dir / "plain.txt")}, capture_output=True, timeout=60)
    child = server.spawn(command, {**env, "OUT": str(out_dir / "forked.txt")})
    out, err = child.stdout.read(), child.stderr.read()
    return (plain.returncode, plain.stdout, plain.stderr), (child.wait(60), out, err)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "exit-text", "exit-7", "raise", "interrupt", "thread", "file"])
def test_a_forked_script_ends_as_the_same_script_run_by_python(server, tmp_path, mode):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "MODE": mode, "PYTHONUNBUFFERED": "1"}
    plain, forked = run_both(server, [sys.executable, str(script), "a", "b"], env, tmp_path)
    assert forked == plain   # exit status, output and traceback, line for line
    if mode == "file":
        assert (tmp_path / "plain.txt").read_text() == (tmp_path / "forked.txt").read_text() == "an unflushed tail"
    assert b"fds []" in forked[1]   # nothing of the server's (its socket, its wakeup pipe) leaked in


@pytest.mark.slow
def test_a_forked_module_runs_as_python_dash_m_and_numpy_draws_its_own_numbers(server, tmp_path, monkeypatch):
    (tmp_path / "probemod.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "MODE": "ok", "PYTHONUNBUFFERED": "1"}
    plain, forked = run_both(server, [sys.executable, "-m", "probemod", "x"], env, tmp_path)
    assert forked == plain
    # numpy's global random state: the server's copy is reseeded in each worker, as a new process seeds it
    draws = set()
    for _ in range(3):
        child = server.spawn([sys.executable, "-m", "probemod"], {**env, "MODE": "numpy"})
        assert child.wait(60) == 0
        draws.add(re.search(rb"draw (\d+)", child.stdout.read()).group(1))
    assert len(draws) == 3, draws


@pytest.mark.slow
def test_a_forked_worker_runs_in_the_directory_asked_for_else_in_the_callers(server, tmp_path, monkeypatch):
    asked = tmp_path / "asked"
    asked.mkdir()
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "where.py"
    script.write_text("import os\nprint(os.getcwd())\n")
    command = [sys.executable, str(script)]
    for cwd, expected in ((str(asked), asked), (None, tmp_path)):
        child = server.spawn(command, dict(os.environ), cwd=cwd)
        out = child.stdout.read()
        assert child.wait(60) == 0
        assert out.decode().strip() == str(expected)


@pytest.mark.slow
def test_a_forked_workers_stdout_and_stderr_can_both_go_to_one_descriptor_in_order(server, tmp_path):
    script = tmp_path / "both.py"
    script.write_text("import sys\nfor i in range(3):\n    print('out', i, flush=True)\n"
                      "    print('err', i, file=sys.stderr, flush=True)\n")
    with open(tmp_path / "log.txt", "wb") as log:
        child = server.spawn([sys.executable, str(script)], dict(os.environ), output=log.fileno())
    assert child.stdout is None and child.stderr is None
    assert child.wait(60) == 0
    assert (tmp_path / "log.txt").read_text().splitlines() == ["out 0", "err 0", "out 1", "err 1", "out 2", "err 2"]


@pytest.mark.slow
def test_the_server_refuses_a_command_it_cannot_run_and_forks_the_next(server, tmp_path):
    with pytest.raises(ForkServerError, match="refused the worker: not a command this interpreter runs"):
        server.spawn(["/bin/sh", "-c", "id"], dict(os.environ))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    child = server.spawn([sys.executable, str(script)], {**os.environ, "MODE": "exit-7"})
    assert child.wait(60) == 7


@pytest.mark.slow
def test_a_launcher_killed_takes_its_fork_server_and_workers(tmp_path):
    """SIGKILL to elastic-run: the server dies with it (parent-death signal), and the workers with the server."""
    from .launch_helpers import LaunchProc
    p = LaunchProc(tmp_path, "--np", "2", "--host", "hA", "--preload", "numpy", LW_STEPS="100000")
    try:
        p.wait_training(2)
        pids = [pid_of(p, w) for w in ("hA-0", "hA-1")]
        p.proc.kill()
        p.proc.wait(10)
        wait_until(lambda: not p.leftovers() and not any(os.path.exists(f"/proc/{x}") for x in pids), 15,
                   "the fork server and its workers to die with the launcher")
    finally:
        p.close()


# ---------------------------------------------------------------------------------------------- real launcher
def pid_of(p, worker_id):
    return int(open(os.path.join(p.out_dir, f"pid-{worker_id}.txt")).read())


def preloaded_lines(p):
    """worker id -> (modules imported before its script ran, its parent's pid), from LW_PRINT_PRELOADED."""
    out = {}
    for line in p.stdout:
        m = re.fullmatch(r"\[(\S+)\] preloaded (\S+) ppid (\d+) argv \[.*\]", line)
        if m:
            out[m.group(1)] = (m.group(2), int(m.group(3)))
    return out


@pytest.mark.slow
def test_preloaded_workers_and_a_respawn_are_forked_from_the_server_and_reported_as_any_worker(launch):
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", "--max-restarts", "1", "--preload", "torch",
               LW_STEPS="150", LW_PRINT_PRELOADED="1")
    server = int(p.wait_for(r"preloaded torch in [0-9.]+ s: workers are forked from its process \(pid (\d+)\)",
                            120).group(1))
    p.wait_training(3)
    p.kill_worker("hA-1")
    # The exit status travels from the server: the launcher names the signal, as for any worker.
    p.wait_for(r"worker hA-1 \(rank \d\) killed by SIGKILL; respawning it in 0.5 s \(restart 1 of 1\)", 10)
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hA-1-r1", 30)
    assert p.wait(90) == 0, p.text()
    assert sorted(l for l in p.stdout if l.endswith("] done")) == ["[hA-0] done", "[hA-1-r1] done", "[hA-2] done"]
    # torch was in each worker before its script ran (the script never imports it), and each, the
    # respawn too, is the server's child, not the launcher's.
    lines = preloaded_lines(p)
    assert set(lines) == {"hA-0", "hA-1", "hA-2", "hA-1-r1"}, p.text()
    assert all("torch" in modules.split(",") and parent == server for modules, parent in lines.values()), lines
    assert server != p.proc.pid
    # Each has its own environment: its id named its pid file, and that pid is the one the launcher
    # reported for it.
    started = dict(re.findall(r"(hA-\d(?:-r1)?) \(pid (\d+)\)", "\n".join(p.stderr)))
    assert {w: pid_of(p, w) for w in lines} == {w: int(started[w]) for w in lines}, p.text()
    p.wait_no_leftovers()


@pytest.mark.slow
def test_a_preloaded_workers_error_and_exit_status_end_the_job_as_without_preload(launch):
    p = launch("--np", "2", "--host", "hA", "--preload", "numpy", LW_RAISE_AT="6")
    assert p.wait(60) == 1, p.text()
    assert re.fullmatch(r"elastic-run: error: worker hA-[01] \(rank [01]\) exited with status 1: ValueError: "
                        r"deterministic user error at step 6; job default stopped", last_line(p)), p.text()
    p.wait_no_leftovers()
    q = launch("--np", "2", "--host", "hA", "--preload", "numpy", LW_STEPS="6", LW_EXIT_AFTER_RUN="hA-1:3")
    assert q.wait(60) == 1, q.text()
    assert re.fullmatch(r"elastic-run: error: worker hA-1 \(rank [01]\) exited with status 3 after job default "
                        r"completed", last_line(q)), q.text()
    q.wait_no_leftovers()


@pytest.mark.slow
def test_a_module_that_does_not_import_fails_the_launch_naming_it(launch):
    p = launch("--np", "1", "--host", "hA", "--preload", "no_such_module_here")
    assert p.wait(60) == 1, p.text()
    assert last_line(p) == ("elastic-run: error: --preload: cannot import no_such_module_here: ModuleNotFoundError: "
                            "No module named 'no_such_module_here'"), p.text()
    p.wait_no_leftovers()


@pytest.mark.slow
def test_a_killed_fork_server_takes_its_workers_and_the_job_goes_on_with_new_processes(launch):
    p = launch("--np", "2", "--min-np", "1", "--host", "hA", "--max-restarts", "2", "--preload", "numpy",
               LW_STEPS="150", LW_PRINT_PRELOADED="1")
    server = int(p.wait_for(r"workers are forked from its process \(pid (\d+)\)", 60).group(1))
    p.wait_training(2)
    os.kill(server, signal.SIGKILL)
    # Its workers die with it (their parent-death signal), are reported killed, and come back as
    # new processes: nothing preloaded, the launcher their parent.
    p.wait_for(r"--preload: .+; worker hA-[01]-r1 and those after it start as new processes", 20)
    for w in ("hA-0-r1", "hA-1-r1"):   # together or one after the other
        p.wait_for(rf"world \d+: \d worker\(s\);.* joined: (\S+, )?{w}\b", 60)
    assert p.wait(90) == 0, p.text()
    lines = preloaded_lines(p)
    assert lines["hA-0"] == lines["hA-1"] == ("numpy", server), lines
    for w in ("hA-0-r1", "hA-1-r1"):
        modules, parent = lines[w]
        assert modules == "nothing" and parent != server, lines
    wait_until(lambda: not os.path.exists(f"/proc/{server}"), 10, "the server to be reaped")
    for w in ("hA-0", "hA-1"):   # really gone, not only reported so
        assert not os.path.exists(f"/proc/{pid_of(p, w)}"), w
    p.wait_no_leftovers()
