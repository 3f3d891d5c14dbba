"""elastic-run end to end: real launcher, real rendezvous server, real worker processes."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from .launch_helpers import REPO, processes_with, wait_until

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

LINEAR = os.path.join(REPO, "examples", "train_linear.py")
CNN = os.path.join(REPO, "examples", "train_cnn.py")


def discovery_script(tmp_path, listing: str):
    """A host-discovery script that prints the hosts file; the test rewrites the file to change it."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(listing)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return hosts, script


def last_line(p) -> str:
    return p.stderr[-1] if p.stderr else ""


def test_happy_path_trains_the_linear_example_to_the_known_weights(launch):
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, LINEAR, "--epochs", "4"])
    assert p.wait(120) == 0, p.text()
    p.wait_for(r"^\[hA-[01]\] epoch 3: loss [0-9.]+ on 2 worker", 1)   # rank 0 prints the loss
    errors = [float(m) for m in re.findall(r"max \|w - w_true\| = ([0-9.]+)", p.text())]
    assert len(errors) == 2 and max(errors) < 0.01, p.text()
    assert last_line(p) == "elastic-run: job default completed"
    p.wait_no_leftovers()


@pytest.mark.slow
def test_a_script_given_as_torchrun_takes_it_runs_with_this_python(launch):
    p = launch("--np", "1", "--host", "hA", command=[LINEAR, "--epochs", "1"])   # no 'python' before it
    assert p.wait(120) == 0, p.text()
    assert last_line(p) == "elastic-run: job default completed"


def test_cnn_example_learns_the_synthetic_classes(launch):
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, CNN, "--epochs", "2"])
    assert p.wait(120) == 0, p.text()
    accuracies = [float(a) for a in re.findall(r"accuracy on fresh images ([0-9.]+)", p.text())]
    assert len(accuracies) == 2 and min(accuracies) > 0.9, p.text()


def test_worker_killed_by_a_signal_is_respawned_and_the_world_regrows(launch):
    p = launch("--np", "3", "--min-np", "1", "--host", "hA", "--max-restarts", "1", LW_STEPS="150")
    p.wait_training(3)
    p.kill_worker("hA-1")
    p.wait_for(r"worker hA-1 \(rank \d\) killed by SIGKILL; respawning it in 0.5 s \(restart 1 of 1\)", 10)
    recovered = p.wait_for(r"world \d+: 2 worker\(s\); left: hA-1; recovered ([0-9.]+) s after hA-1 killed", 15)
    assert float(recovered.group(1)) < 5
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hA-1-r1", 30)
    p.wait_for(r"^\[hA-1-r1\] step \d+ size 3$", 30, stream="out")
    p.finish()
    assert p.wait(60) == 0, p.text()
    assert re.match(r"elastic-run: job default completed \(1 recovery\(ies\), [0-9.]+-[0-9.]+ s each\)",
                    last_line(p)), p.text()
    assert sorted(l for l in p.stdout if l.endswith("] done")) == ["[hA-0] done", "[hA-1-r1] done", "[hA-2] done"]
    p.wait_no_leftovers()


def test_worker_killed_without_respawn_leaves_a_smaller_world_that_finishes(launch):
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", "--max-restarts", "0", LW_STEPS="120")
    p.wait_training(3)
    p.kill_worker("hA-2")
    p.wait_for(r"worker hA-2 \(rank \d\) killed by SIGKILL; not respawned \(--max-restarts 0\)", 10)
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2; recovered", 15)
    p.finish()
    assert p.wait(60) == 0, p.text()
    assert sorted(l for l in p.stdout if l.endswith("] done")) == ["[hA-0] done", "[hA-1] done"]
    assert not os.path.exists(os.path.join(p.out_dir, "pid-hA-2-r1.txt"))


def test_a_worker_outvoted_every_time_is_respawned_until_its_third_divergence_and_the_job_goes_on(launch):
    # Slot 2 runs a "stale image": in a world of three it allreduces one element more than the
    # others. The world compares what each rank called, the two others outvote it, it exits 76
    # (elastic.Outvoted); elastic-run respawns it twice, then says why it stops, and the other
    # two finish the job.
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", "--max-restarts", "5", LW_STEPS="100000",
               LW_DIVERGE="2:4")
    for n, label in enumerate(["hA-2", "hA-2-r1", "hA-2-r2"], start=1):
        # (its rank is not named once its world is gone)
        line = p.wait_for(rf"worker {label}(?: \(rank \d\))? exited with status 76 \(outvoted: it called other "
                          r"collectives, or formed its ring with other settings, than the majority of its world\); "
                          r"(.*)$", 90)
        if n < 3:
            assert line.group(1).startswith("respawning it in ") and f"outvoted {n} of 3 times" in line.group(1)
        else:
            assert line.group(1).startswith("not respawned: outvoted 3 times"), line.group(0)
    p.wait_for(r"^\[hA-[01]\] step \d+ size 2$", 30, stream="out")
    p.finish()
    assert p.wait(120) == 0, p.text()
    assert sorted(l for l in p.stdout if l.endswith("] done")) == ["[hA-0] done", "[hA-1] done"]
    outvoted = [l for l in p.stderr if l.startswith("[hA-2") and "differs from the majority of the world" in l]
    assert len(outvoted) == 3, p.text()
    assert not os.path.exists(os.path.join(p.out_dir, "pid-hA-2-r3.txt"))
    p.wait_no_leftovers()


def test_below_min_np_fails_within_the_elastic_timeout_and_leaves_nothing(launch):
    p = launch("--np", "2", "--min-np", "2", "--max-restarts", "0", "--elastic-timeout", "3", "--host", "hA",
               LW_STEPS="100000")
    p.wait_training(2)
    p.kill_worker("hA-0")
    killed = time.monotonic()
    p.wait_for(r"below min-np=2: 1 worker\(s\) left; the job fails if it stays below for 3 s", 10)
    assert p.wait(30) == 3, p.text()   # its own status: a batch script may requeue such a job
    took = time.monotonic() - killed
    assert 3 <= took < 3 + 8, f"failed {took:.1f} s after the kill"
    assert re.fullmatch(r"elastic-run: error: job default failed: only 1 eligible worker\(s\), below min_np=2, "
                        r"for the elastic timeout of 3 s \(last failure on this host: worker hA-0 \(rank \d\) "
                        r"killed by SIGKILL\)", last_line(p)), p.text()
    # The survivor's elastic.run ends with the contract's exception for a wait that ran out.
    assert any(line.startswith("[hA-1] elastic.ElasticTimeout: job default finished") for line in p.stderr), \
        p.text()
    p.wait_no_leftovers()


def test_worker_error_ends_the_job_with_a_one_line_reason_and_no_respawn(launch):
    p = launch("--np", "2", "--host", "hA", LW_RAISE_AT="6")
    assert p.wait(60) == 1, p.text()
    assert re.fullmatch(r"elastic-run: error: worker hA-[01] \(rank [01]\) exited with status 1: ValueError: "
                        r"deterministic user error at step 6; job default stopped", last_line(p)), p.text()
    assert "respawning" not in p.text()
    p.wait_no_leftovers()


def test_second_launcher_joins_the_running_job_and_the_world_grows_at_a_commit(launch):
    a = launch("--np", "2", "--host", "hA", LW_STEPS="200")
    address = a.wait_for(r"rendezvous server for job default on (127\.0\.0\.1:\d+) \(embedded\)", 30).group(1)
    token_file = a.wait_for(r"its token is in (\S+) \(readable by this user only\)", 5).group(1)
    a.wait_training(2)
    b = launch("--np", "1", "--host", "hB", "--rendezvous", address, "--job-id", "default",
               "--token-file", token_file, LW_STEPS="200")
    b.wait_for(r"joining job default at world \d+ \(2 worker\(s\), phase RUNNING\)", 30)
    a.wait_for(r"world \d+: 3 worker\(s\); joined: hB-0$", 30)
    b.wait_for(r"world \d+: 3 worker\(s\); joined: hB-0 \([0-9.]+ s after start\)", 30)
    # The newcomer trains in the grown world.
    b.wait_for(r"^\[hB-0\] step \d+ size 3$", 30, stream="out")
    a.finish()
    assert b.wait(60) == 0, b.text()
    assert a.wait(60) == 0, a.text()
    assert not any("restoring commit" in l for l in a.stderr), "a clean join must not look like a failure"
    a.wait_no_leftovers()
    b.wait_no_leftovers()


def two_hosts_training(launch):
    """Launchers of hosts hA (with the embedded server) and hB (joined), a worker each, training together."""
    a = launch("--np", "1", "--host", "hA", LW_STEPS="100000")
    address = a.wait_for(r"rendezvous server for job default on (127\.0\.0\.1:\d+) \(embedded\)", 30).group(1)
    token_file = a.wait_for(r"its token is in (\S+) \(readable by this user only\)", 5).group(1)
    b = launch("--np", "1", "--host", "hB", "--rendezvous", address, "--job-id", "default",
               "--token-file", token_file, LW_STEPS="100000")
    b.wait_for(r"^\[hB-0\] step \d+ size 2$", 30, stream="out")
    return a, b


def test_a_joined_launcher_that_looks_after_its_worker_exited_still_hears_the_job_completed(launch):
    # The launcher of another host learns the job's end from the embedded server. Stopped while
    # the job ends, it first looks once its worker has exited 0: the server must still answer, or
    # that exit would pass for a graceful leave ("left (preempted)").
    a, b = two_hosts_training(launch)
    b.proc.send_signal(signal.SIGSTOP)   # the launcher only: its worker runs in a process group of its own
    try:
        a.finish()
        # The worker has exited (a zombie of the stopped launcher) when the launcher looks: after the
        # server saw the worker go, inside the 2 s it stays up for such launchers. (A further 0.5 s
        # here used up that margin on a loaded 2-core CI run.)
        wait_until(lambda: processes_with(b.marker) == [b.proc.pid], 30, "hB-0 exited")
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert b.wait(60) == 0, b.text()
    assert a.wait(60) == 0, a.text()
    assert any(line.startswith("elastic-run: job default completed") for line in b.stderr), b.text()
    assert not any("left (preempted" in line for line in b.stderr), b.text()
    assert any(line.startswith("elastic-run: job default completed") for line in a.stderr), a.text()
    a.wait_no_leftovers()
    b.wait_no_leftovers()


def test_a_signal_while_the_server_waits_for_other_hosts_launchers_still_ends_a_completed_job_with_0(launch):
    a, b = two_hosts_training(launch)
    a.finish()
    # hA's launcher says the job completed at once, then keeps its server up until hB-0 detached and
    # 2 s more, for hB's launcher. A SIGTERM then (a time limit, scancel) ends that wait; the job
    # had completed, and the exit status says so.
    a.wait_for(r"^elastic-run: job default completed$", 60)
    a.proc.send_signal(signal.SIGTERM)
    assert b.wait(60) == 0, b.text()
    assert a.wait(30) == 0, a.text()
    assert last_line(a).startswith("elastic-run: job default completed"), a.text()
    assert not any("stopped by SIGTERM" in line for line in a.stderr), a.text()
    a.wait_no_leftovers()
    b.wait_no_leftovers()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_worker_and_the_server(launch, sig):
    p = launch("--np", "3", "--host", "hA", LW_STEPS="100000")
    p.wait_for(r"world \d+: 3 worker\(s\)", 30)
    assert len(p.leftovers()) >= 4  # 3 workers and the embedded server
    p.proc.send_signal(sig)
    assert p.wait(20) == 128 + sig, p.text()
    assert last_line(p) == f"elastic-run: stopped by {signal.Signals(sig).name}"
    assert p.leftovers() == []


def test_a_killed_launcher_takes_its_workers_and_server_with_it(launch):
    p = launch("--np", "2", "--host", "hA", LW_STEPS="100000")
    p.wait_for(r"world \d+: 2 worker\(s\)", 30)
    p.proc.kill()
    p.wait(10)
    p.wait_no_leftovers(10)


@pytest.mark.parametrize("args, message", [
    (["--np", "2", "--bogus"], r"unrecognized arguments: --bogus"),
    (["--np", "0"], r"--np must be at least 1, got 0"),
    (["--np", "two"], r"argument --np: invalid int value: 'two'"),
    (["--np", "2", "--min-np", "0"], r"need 1 <= --min-np <= --max-np <= 2048, got 0 and 1024"),
    (["--np", "2", "--min-np", "3", "--max-np", "2"], r"need 1 <= --min-np <= --max-np <= 2048, got 3 and 2"),
    # Without --rendezvous this launcher's workers are the whole job: it could never start.
    (["--np", "2", "--min-np", "3"], r"--min-np 3 is more than --np 2, the workers this launcher runs"),
    (["--np", "2", "--rendezvous", "nohost"], r"--rendezvous: 'nohost' is not HOST:PORT"),
    (["--np", "2", "--rendezvous", "127.0.0.1:5"], r"--rendezvous needs --job-id"),
    (["--np", "2", "--port", "5", "--rendezvous", "127.0.0.1:5"], r"not allowed with argument"),
    (["--np", "2", "--job-id", "bad id"], r"--job-id 'bad id': use 1-128 characters"),
    (["--np", "2", "--elastic-timeout", "0"], r"--elastic-timeout must be in"),
    (["--np", "2", "--host-discovery-script", "/nonexistent"], r"is not an executable file"),
    (["--np", "2", "--preempt-grace", "0"], r"--preempt-grace must be in \(0, 86400\] seconds, got 0"),
])
def test_bad_flags_give_a_one_line_error(launch, args, message):
    p = launch(*args)
    assert p.wait(30) == 2
    assert len(p.stderr) == 1 and p.stdout == [], p.text()
    assert re.match(r"elastic-run: error: .*" + message, p.stderr[0]), p.stderr[0]


def test_missing_command_and_unknown_command_give_a_one_line_error(launch):
    p = launch("--np", "2", command=["no-such-command-xyz"])
    assert p.wait(30) == 2
    assert p.stderr == ["elastic-run: error: worker command 'no-such-command-xyz' not found (not an executable, "
                        "nor on PATH; a script runs as 'elastic-run ... train.py' or '-- python train.py') (see "
                        "elastic-run --help)"]


def test_unreachable_rendezvous_gives_a_one_line_error(launch):
    p = launch("--np", "2", "--rendezvous", "127.0.0.1:1", "--job-id", "j", "--connect-timeout", "1")
    assert p.wait(30) == 1
    assert len(p.stderr) == 1, p.text()
    assert p.stderr[0].startswith("elastic-run: error: cannot reach the rendezvous server at 127.0.0.1:1: "
                                  "UNAVAILABLE"), p.stderr[0]
    p.wait_no_leftovers()


def test_help_documents_the_flags_and_the_worker_environment(launch):
    p = launch("--help")
    assert p.wait(30) == 0
    text = "\n".join(p.stdout)
    for flag in ("--np", "--min-np", "--max-np", "--max-restarts", "--elastic-timeout", "--port", "--rendezvous",
                 "--job-id", "--host", "--host-discovery-script"):
        assert flag in text
    for var in ("ELASTIC_RENDEZVOUS", "ELASTIC_JOB_ID", "ELASTIC_WORKER_ID", "ELASTIC_HOST", "ELASTIC_MIN_NP",
                "ELASTIC_MAX_NP", "ELASTIC_ELASTIC_TIMEOUT"):
        assert var in text


def test_discovery_script_sets_the_slots_of_this_host(launch, tmp_path):
    hosts, script = discovery_script(tmp_path, "hD:2\nother-host:4\n")
    p = launch("--host", "hD", "--host-discovery-script", str(script), "--discovery-interval", "0.2",
               LW_STEPS="200")
    p.wait_for(r"discovery: 2 slot\(s\) on this host \(hD\); other hosts, not started by this launcher "
               r"\(run elastic-run --rendezvous there\): other-host:4", 30)
    p.wait_for(r"world \d+: 2 worker\(s\)", 30)
    tmp = tmp_path / "hosts.tmp"
    tmp.write_text("hD:3\n")
    tmp.replace(hosts)
    p.wait_for(r"discovery: 3 slot\(s\) on this host \(hD\)$", 10)
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hD-2", 30)
    p.wait_for(r"^\[hD-2\] step \d+ size 3$", 30, stream="out")
    p.finish()
    assert p.wait(60) == 0, p.text()


def test_a_joining_launcher_refuses_a_host_already_in_the_job_and_a_different_spec(launch):
    a = launch("--np", "2", "--host", "hA", LW_STEPS="100000")
    address = a.wait_for(r"rendezvous server for job default on (127\.0\.0\.1:\d+) \(embedded\)", 30).group(1)
    token_file = a.wait_for(r"its token is in (\S+) \(readable by this user only\)", 5).group(1)
    a.wait_for(r"world \d+: 2 worker\(s\)", 30)
    same_host = launch("--np", "1", "--host", "hA", "--rendezvous", address, "--job-id", "default",
                       "--token-file", token_file)
    other_spec = launch("--np", "1", "--host", "hB", "--min-np", "3", "--rendezvous", address, "--job-id", "default",
                        "--token-file", token_file)
    assert same_host.wait(30) == 1 and other_spec.wait(30) == 1
    assert same_host.stderr == ["elastic-run: error: job default already has workers from host hA: give this "
                                "launcher another --host"], same_host.text()
    assert other_spec.stderr == ["elastic-run: error: job default runs with --min-np 2 --max-np 1024; this "
                                 "launcher asks for 3 and 1024"], other_spec.text()
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(20) == 128 + signal.SIGTERM
    a.wait_no_leftovers()


def test_a_port_in_use_is_a_one_line_flag_error(launch):
    # The port is held by another launcher's embedded server.
    a = launch("--np", "1", "--host", "hA", LW_STEPS="100000")
    port = a.wait_for(r"rendezvous server for job default on 127\.0\.0\.1:(\d+) \(embedded\)", 30).group(1)
    b = launch("--np", "1", "--host", "hB", "--port", port)
    assert b.wait(30) == 2, b.text()
    assert b.stderr == [f"elastic-run: error: --port {port}: 127.0.0.1:{port} is already in use "
                        "(see elastic-run --help)"], b.text()
    assert b.stdout == []
    assert a.proc.poll() is None
    a.proc.send_signal(signal.SIGTERM)
    assert a.wait(20) == 128 + signal.SIGTERM
    b.wait_no_leftovers()


def test_every_line_of_a_worker_carries_its_worker_id_for_its_whole_life(launch):
    # Before the world forms, in it, and after the job ended: one prefix, whatever the rank.
    p = launch("--np", "2", "--host", "hA", LW_STEPS="6")
    assert p.wait(60) == 0, p.text()
    for w in ("hA-0", "hA-1"):
        words = [line.split()[1] for line in p.stdout if line.startswith(f"[{w}] ")]
        assert words == ["start"] + ["step"] * 6 + ["done", "result", "after", "collective", "collective"], p.text()
    assert len(p.stdout) == 2 * 12, p.text()
    # The runtime's log lines too (stderr), rank announcements included.
    worker_err = [line for line in p.stderr if not line.startswith(("elastic-run: ", "[rendezvous] "))]
    assert worker_err and all(re.match(r"\[hA-[01]\] ", line) for line in worker_err), p.text()
    assert any(re.match(r"\[hA-0\] .*worker hA-0 is rank \d", line) for line in worker_err), p.text()


@pytest.mark.parametrize("env, how", [
    ({"LW_EXIT_AFTER_RUN": "hA-1:3"}, "exited with status 3 after job default completed"),
    ({"LW_RAISE_AFTER_RUN": "hA-1"},
     "exited with status 1 after job default completed: RuntimeError: failed after training"),
])
def test_a_worker_failing_after_the_job_completed_fails_the_launcher_naming_it(launch, env, how):
    p = launch("--np", "2", "--host", "hA", LW_STEPS="6", **env)
    assert p.wait(60) == 1, p.text()
    assert re.fullmatch(r"elastic-run: error: worker hA-1 \(rank [01]\) " + re.escape(how), last_line(p)), p.text()
    assert "[hA-0] done" in p.stdout and "[hA-1] done" in p.stdout
    p.wait_no_leftovers()


def test_a_member_that_skips_the_final_barrier_is_named_in_the_launcher_s_last_line(launch):
    # hA-2 sleeps through the barrier the others entered: they are released after
    # ELASTIC_AFTER_RUN_TIMEOUT (not the collective timeout), their barrier raises, and the
    # error of the worker after hA-2 on the ring, which names it, is in the launcher's line.
    p = launch("--np", "3", "--host", "hA", LW_STEPS="6", LW_SKIP_BARRIER="hA-2:6", ELASTIC_AFTER_RUN_TIMEOUT="2")
    assert p.wait(90) == 1, p.text()
    line = last_line(p)
    assert re.search(r"worker hA-2 \(rank \d\) did not arrive at barrier within 2 s \(ELASTIC_AFTER_RUN_TIMEOUT\)",
                     line), p.text()
    assert line.startswith("elastic-run: error: worker hA-") and "exited with status 1 after job default completed" \
        in line, p.text()
    # It comes late, after the others' barrier failed: its own collective fails too, never runs.
    assert re.search(r"\[hA-2\] collective after run: \w+Error", p.text()), p.text()
    p.wait_no_leftovers()


def test_after_run_returns_every_worker_has_its_result_its_last_world_and_ring_until_shutdown(launch):
    p = launch("--np", "2", "--host", "hA", LW_STEPS="6")
    assert p.wait(60) == 0, p.text()
    out = "\n".join(p.stdout)
    for w in ("hA-0", "hA-1"):
        # Six steps of an allreduce of ones over two workers: 12.0, returned on every worker.
        assert f"[{w}] result 12.0" in out, p.text()
        assert f"[{w}] collective after run: 2" in out, p.text()
        assert f"[{w}] collective after shutdown: RendezvousError: job default has finished" in out, p.text()
    ranks = sorted(int(m.group(1)) for m in re.finditer(r"\] after rank (\d) size 2 version \d+", out))
    assert ranks == [0, 1], p.text()


def test_a_worker_sent_sigterm_leaves_at_a_commit_is_reported_and_not_respawned(launch):
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", LW_STEPS="150")
    p.wait_training(3)
    p.kill_worker("hA-2", signal.SIGTERM)
    p.wait_for(r"^elastic-run: worker hA-2 \(rank \d\) left \(preempted\); not respawned$", 15)
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2", 15)
    p.finish()
    assert p.wait(60) == 0, p.text()
    assert re.match(r"elastic-run: job default completed", last_line(p)), p.text()
    assert sorted(l for l in p.stdout if l.endswith("] done")) == ["[hA-0] done", "[hA-1] done"]
    assert not os.path.exists(os.path.join(p.out_dir, "pid-hA-2-r1.txt")), "a worker that left was respawned"
    # The survivors kept their state: a clean leave, not a failure.
    assert not any("restoring commit" in l for l in p.stderr), p.text()
    assert any(l.startswith("[hA-2] ") and "left job default gracefully (SIGTERM)" in l for l in p.stderr), p.text()
    p.wait_no_leftovers()


def test_sigterm_to_one_of_two_launchers_drains_its_workers_and_the_job_goes_on(launch, tmp_path):
    from tests.rendezvous.rdzv_helpers import ServerProc

    server = ServerProc(tmp_path, "--insecure", "--settle", "0.2")
    try:
        args = ("--rendezvous", server.address, "--job-id", "j")
        a = launch("--np", "2", "--host", "hA", *args, LW_STEPS="300")
        a.wait_training(2)
        b = launch("--np", "1", "--host", "hB", *args, LW_STEPS="300")
        b.wait_for(r"^\[hB-0\] step \d+ size 3$", 30, stream="out")
        b.proc.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, b.text()
        # The rank is named when the launcher's Status polls saw one before it left.
        b.wait_for(r"^elastic-run: worker hB-0( \(rank \d\))? left \(preempted: SIGTERM to elastic-run\)$", 1)
        assert last_line(b) == "elastic-run: every worker left job j gracefully on SIGTERM; it goes on without host hB"
        # hA's workers re-form without it at a commit (the launcher's own world lines depend on
        # when it polls Status, so the workers' line is the one to wait for).
        a.wait_for(r"rank\(s\) \d+ leave world version \d+; re-forming without them", 15)
        a.finish()
        assert a.wait(60) == 0, a.text()
        assert last_line(a).startswith("elastic-run: job j completed"), a.text()
        assert not any("restoring commit" in l for l in a.stderr + b.stderr), a.text() + b.text()
        a.wait_no_leftovers()
        b.wait_no_leftovers()
    finally:
        server.kill()


def test_sigterm_to_a_launcher_and_its_worker_at_once_as_slurm_sends_it_is_one_graceful_leave(launch, tmp_path):
    # Slurm signals every process of a step: the worker gets SIGTERM from Slurm and again from its
    # launcher passing it on. The second is the same request, not "insist": it still leaves.
    from tests.rendezvous.rdzv_helpers import ServerProc

    server = ServerProc(tmp_path, "--insecure", "--settle", "0.2")
    try:
        args = ("--rendezvous", server.address, "--job-id", "j")
        a = launch("--np", "2", "--host", "hA", *args, LW_STEPS="300")
        a.wait_training(2)
        b = launch("--np", "1", "--host", "hB", *args, LW_STEPS="300")
        b.wait_for(r"^\[hB-0\] step \d+ size 3$", 30, stream="out")
        b.kill_worker("hB-0", signal.SIGTERM)
        b.proc.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, b.text()
        b.wait_for(r"^elastic-run: worker hB-0( \(rank \d\))? left \(preempted: SIGTERM to elastic-run\)$", 1)
        assert any(l.startswith("[hB-0] ") and "left job j gracefully (SIGTERM)" in l for l in b.stderr), b.text()
        a.finish()
        assert a.wait(60) == 0, a.text()
        assert not any("restoring commit" in l for l in a.stderr + b.stderr), a.text() + b.text()
    finally:
        server.kill()


def test_a_slot_the_discovery_script_takes_away_is_drained_without_a_restore(launch, tmp_path):
    hosts, script = discovery_script(tmp_path, "hD:3\n")
    p = launch("--host", "hD", "--host-discovery-script", str(script), "--discovery-interval", "0.2",
               "--min-np", "2", LW_STEPS="200")
    p.wait_training(3)
    tmp = tmp_path / "hosts.tmp"
    tmp.write_text("hD:2\n")
    tmp.replace(hosts)
    p.wait_for(r"draining worker hD-2 \(rank \d\): discovery gives this host 2 slot\(s\)", 10)
    p.wait_for(r"worker hD-2 \(rank \d\) left \(drained: discovery gives this host 2 slot\(s\)\)", 15)
    p.wait_for(r"world \d+: 2 worker\(s\); left: hD-2", 15)
    p.finish()
    assert p.wait(60) == 0, p.text()
    assert not any("restoring commit" in l for l in p.stderr), p.text()
    assert not os.path.exists(os.path.join(p.out_dir, "pid-hD-2-r1.txt"))
