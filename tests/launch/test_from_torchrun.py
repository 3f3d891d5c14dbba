"""What a torchrun user meets first, with real launchers, a real rendezvous server and real
workers: hosts joining one job in any order, errors that name the fix, the worker
environment torchrun scripts and libraries read."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from rendezvous.client.status_client import StatusClient
from tests.rendezvous.rdzv_helpers import ServerProc
from tests.waiting import wait_until

from .launch_helpers import REPO, WORKER

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

TOKEN = "tok-" + "x" * 28


@pytest.fixture
def server(tmp_path):
    """`elastic-rendezvous serve --token-file F` (in-memory store), as a second host's launcher
    would find it; yields (server, token file)."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    s = ServerProc(tmp_path, "--token-file", str(token), "--settle", "0.2")
    yield s, str(token)
    s.kill()


def _last(p) -> str:
    return p.stderr[-1] if p.stderr else ""


def test_a_later_launcher_without_min_np_takes_the_job_limits_whenever_its_worker_joins(launch, server, tmp_path):
    srv, token = server
    go = tmp_path / "hostB-may-join"
    args = ("--rendezvous", srv.address, "--job-id", "exp7", "--token-file", token)
    # Host B's launcher starts first: no job yet, so its own default would be --min-np = --np = 1 ...
    b = launch("--np", "1", "--host", "hostB", *args, LW_STEPS="30", LW_JOIN_AFTER=str(go))
    b.wait_for(r"^\[hostB-0\] start$", 30, stream="out")   # its launcher checked the job and started it
    a = launch("--np", "1", "--min-np", "2", "--host", "hostA", *args, LW_STEPS="30")
    # ... but its worker joins after host A's created the job with min-np 2: it takes the job's.
    with StatusClient([srv.address], token=TOKEN) as status:
        job = wait_until(lambda: status.job("exp7"), 30, "host A's worker to create job exp7")
        assert (job.min_np, job.max_np) == (2, 1024)
    go.touch()
    assert b.wait(90) == 0, b.text()
    assert a.wait(90) == 0, a.text()
    for p in (a, b):
        p.wait_for(r"world \d+: 2 worker\(s\)", 1)
        assert _last(p).startswith("elastic-run: job exp7 completed"), p.text()
    a.wait_no_leftovers()
    b.wait_no_leftovers()


def test_a_launcher_of_a_shared_job_that_gives_up_says_it_gave_up_and_the_job_goes_on(launch, server):
    srv, token = server
    args = ("--rendezvous", srv.address, "--job-id", "exp8", "--token-file", token)
    a = launch("--np", "2", "--min-np", "2", "--host", "hostA", *args, LW_STEPS="200")
    a.wait_training(2)
    b = launch("--np", "1", "--host", "hostB", *args, LW_STEPS="200", LW_RAISE_ON="hostB-0:3")
    assert b.wait(60) == 1, b.text()
    # The rank is named once a Status answer gave it; a worker failing at its third step may beat that.
    assert re.fullmatch(r"elastic-run: error: worker hostB-0( \(rank \d\))? exited with status 1: ValueError: "
                        r"deterministic user error at step \d+; elastic-run on host hostB gave up and stopped its "
                        r"workers; job exp8 is not stopped by it \(it goes on while its other workers keep it at "
                        r"min-np\)", _last(b)), b.text()
    assert "job exp8 stopped" not in b.text()
    # And it does go on: host A's workers finish it.
    a.finish()
    assert a.wait(90) == 0, a.text()
    assert _last(a).startswith("elastic-run: job exp8 completed"), a.text()
    a.wait_no_leftovers()
    b.wait_no_leftovers()


@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_torchruns_nproc_per_node_is_np(launch, flag):
    p = launch(flag, "2", "--host", "hA", LW_STEPS="6")
    assert p.wait(90) == 0, p.text()
    p.wait_for(r"^elastic-run: world 1: 2 worker\(s\)", 1)
    assert sorted(l for l in p.stdout if l.endswith("] done")) == ["[hA-0] done", "[hA-1] done"]


@pytest.mark.parametrize("args, says", [
    (("--nnodes", "2"), "--nnodes is torchrun's flag: elastic-run counts workers, not nodes: run one elastic-run "
                        "per host with the same --rendezvous and --job-id, and give the job's size in workers with "
                        "--min-np/--max-np"),
    (("--rdzv-endpoint", "10.0.0.1:29400"), "--rdzv-endpoint is torchrun's flag: use --rendezvous "
                                            "HOST:PORT[,HOST:PORT...] (elastic-rendezvous serve on that port)"),
    (("--rdzv_id", "exp7"), "--rdzv_id is torchrun's flag: use --job-id ID"),
    (("--standalone",), "--standalone is torchrun's flag: elastic-run without --rendezvous is standalone already "
                        "(an embedded rendezvous server on 127.0.0.1): drop the flag"),
    (("--node_rank", "0"), "--node_rank is torchrun's flag: ranks come from the rendezvous (they change as "
                           "workers come and go): run one elastic-run per host with a distinct --host instead"),
])
def test_torchrun_flags_without_a_counterpart_say_in_one_line_what_to_use(launch, args, says):
    p = launch("--np", "1", *args)
    assert p.wait(30) == 2, p.text()
    assert p.stderr == [f"elastic-run: error: {says} (see elastic-run --help)"], p.text()
    assert p.stdout == [] and not p.leftovers()


def test_a_torchrun_flag_of_the_worker_command_is_the_commands(launch):
    # After the command starts, a flag is the script's, whatever torchrun calls it.
    p = launch("--np", "1", "--host", "hA", command=[sys.executable, WORKER, "--nnodes", "2"], LW_STEPS="2")
    assert p.wait(60) == 0, p.text()


@pytest.mark.parametrize("given", ["wrong", None])
def test_a_refused_token_says_the_server_refused_it_not_that_it_cannot_be_reached(launch, server, tmp_path, given):
    srv, _ = server
    args = ["--rendezvous", srv.address, "--job-id", "exp9"]
    if given:
        wrong = tmp_path / "wrong-token"
        wrong.write_text("not-the-token\n")
        args += ["--token-file", str(wrong)]
    p = launch("--np", "1", "--host", "hA", *args, ELASTIC_TOKEN="", ELASTIC_TOKEN_FILE="")
    started = time.monotonic()
    assert p.wait(30) == 1, p.text()
    assert time.monotonic() - started < 8, "a refusal is an answer: no retrying until --connect-timeout (10 s)"
    fix = ("the token given (--token-file, ELASTIC_TOKEN or ELASTIC_TOKEN_FILE) is not one in the server's "
           "--token-file" if given else
           "give the token file the server was started with: --token-file F (workers get it as ELASTIC_TOKEN_FILE)")
    assert p.stderr == [f"elastic-run: error: the rendezvous server at {srv.address} refused the token "
                        f"(UNAUTHENTICATED): {fix}"], p.text()
    p.wait_no_leftovers()


def test_a_rank_working_alone_for_less_than_the_collective_timeout_costs_no_restore(launch):
    p = launch("--np", "2", "--host", "hA", "--collective-timeout", "8", LW_STEPS="20", LW_PAUSE="0:6:3")
    assert p.wait(90) == 0, p.text()
    p.wait_for(r"^\[hA-\d\] working alone for 3 s$", 1)
    assert not any("restoring commit" in line for line in p.stderr), p.text()
    assert _last(p) == "elastic-run: job default completed", p.text()


def test_a_world_re_formed_by_a_collective_timeout_says_so_with_every_member_alive(launch):
    p = launch("--np", "2", "--host", "hA", "--collective-timeout", "2", LW_STEPS="20", LW_PAUSE="0:6:5")
    assert p.wait(90) == 0, p.text()
    # The worker waiting on rank 0 restores, and the launcher says why the world re-formed.
    p.wait_for(r"^\[hA-\d\] .*not finished 2 s after this rank entered it \(the collective timeout", 1)
    p.wait_for(r"^elastic-run: world 2: 2 worker\(s\); recovered [0-9.]+ s after collective timeout waiting on "
               r"rank 0 \(hA-\d\), every member alive$", 1)
    assert re.fullmatch(r"elastic-run: job default completed \(1 recovery\(ies\), [0-9.]+-[0-9.]+ s each\)",
                        _last(p)), p.text()


EPOCH_JOB = os.path.join(REPO, "tests", "launch", "epoch_job.py")


def test_a_restore_after_the_end_of_epoch_commit_runs_each_epoch_once_with_its_whole_length(launch):
    # Rank 0 works alone after epoch 0's end-of-epoch commit; rank 1's next collective times
    # out, and both restore that commit: they must go on with epoch 1, not enter epoch 0 again
    # with no batch (its per-epoch line printed twice, "0 samples").
    p = launch("--np", "2", "--host", "hA", "--collective-timeout", "2", command=[sys.executable, EPOCH_JOB],
               EJ_PAUSE="0:4")
    assert p.wait(120) == 0, p.text()
    p.wait_for(r"recovered [0-9.]+ s after collective timeout waiting on rank 0", 1)
    for w in ("hA-0", "hA-1"):
        lines = [l for l in p.stdout if l.startswith(f"[{w}] epoch ")]
        assert lines == [f"[{w}] epoch {e}: 40 samples in all, len(loader) 5, on 2 worker(s)" for e in range(3)], \
            p.text()


def test_a_second_sigint_within_milliseconds_is_the_same_request_and_said_so(launch):
    # GNU timeout and some schedulers forward the signal the launcher got already: one leave.
    p = launch("--np", "2", "--host", "hA", LW_STEPS="100000")
    p.wait_training(2)
    os.kill(p.proc.pid, signal.SIGINT)
    # The repeat comes once the first was handled (two before that are one to Python anyway).
    p.wait_for(r"^elastic-run: SIGINT: draining 2 worker\(s\)", 10)
    os.kill(p.proc.pid, signal.SIGINT)
    assert p.wait(60) == 128 + signal.SIGINT, p.text()
    for w in ("hA-0", "hA-1"):
        p.wait_for(rf"^elastic-run: worker {w}( \(rank \d\))? left \(preempted: SIGINT to elastic-run\)$", 1)
    p.wait_for(r"^elastic-run: a second signal 0\.\d{3} s after the SIGINT was taken for the same request \(a "
               r"wrapper such as GNU timeout forwarding it\); Ctrl-C again \(a second or more after the first\) kills "
               r"the workers at once$", 1)
    assert "signalled again" not in p.text()
    p.wait_no_leftovers()


def test_a_second_sigint_a_second_later_kills_at_once(launch):
    # Steps of 20 s: a worker asked to leave reaches no commit before the second Ctrl-C.
    p = launch("--np", "1", "--host", "hA", LW_STEPS="100000", LW_SLEEP="20")
    p.wait_for(r"^\[hA-0\] step 1 size 1$", 60, stream="out")
    os.kill(p.proc.pid, signal.SIGINT)
    p.wait_for(r"^elastic-run: SIGINT: draining 1 worker\(s\): .*Ctrl-C again kills them at once\)$", 10)
    time.sleep(1.2)   # a person's second Ctrl-C, past the window for echoes (fault injection)
    os.kill(p.proc.pid, signal.SIGINT)
    assert p.wait(30) == 128 + signal.SIGINT, p.text()
    p.wait_for(r"^elastic-run: worker hA-0( \(rank 0\))? did not leave; killing it \(signalled again\)$", 1)
    p.wait_no_leftovers()


def _token_dir(p) -> str:
    return p.wait_for(r"its token is in (\S+)/token \(readable by this user only\)", 60).group(1)


@pytest.mark.parametrize("how, args, env, code", [
    ("a Python error while the job runs", ("--np", "2"), {"LW_RAISE_AT": "3"}, 1),
    ("a Python error as the first world forms", ("--np", "2"), {"LW_RAISE_AT": "0"}, 1),
    ("an error exit after the job completed", ("--np", "2"), {"LW_EXIT_AFTER_RUN": "hA-1:3"}, 1),
    ("a worker error after the job completed", ("--np", "2"), {"LW_RAISE_AFTER_RUN": "hA-0"}, 1),
    ("the job failing below min-np", ("--np", "2", "--max-restarts", "0", "--elastic-timeout", "2"),
     {"LW_STEPS": "100000", "KILL": "hA-1"}, 3),   # exit 3: below --min-np
    ("a SIGTERM to the launcher", ("--np", "2"), {"LW_STEPS": "100000", "SIGNAL": "TERM"}, 128 + signal.SIGTERM),
])
def test_every_way_a_run_ends_removes_the_directory_holding_the_token(launch, how, args, env, code):
    env = dict(env)
    kill, sig = env.pop("KILL", None), env.pop("SIGNAL", None)
    p = launch(*args, "--host", "hA", **env)
    token_dir = _token_dir(p)
    assert os.path.isfile(os.path.join(token_dir, "token"))
    if kill or sig:
        p.wait_training(2)
        if kill:
            p.kill_worker(kill)
        else:
            os.kill(p.proc.pid, getattr(signal, f"SIG{sig}"))
    assert p.wait(90) == code, f"{how}:\n{p.text()}"
    assert not os.path.exists(token_dir), f"{how} left {token_dir}"
    p.wait_no_leftovers()


def test_torchrun_variables_that_stay_true_across_worlds_are_set_and_rank_follows_each_world(launch):
    p = launch("--np", "2", "--min-np", "1", "--host", "hA", "--max-restarts", "1", LW_STEPS="150", LW_PRINT_ENV="1",
               OMP_NUM_THREADS="", RANK="7", WORLD_SIZE="9")
    p.wait_training(2)
    p.kill_worker("hA-1")
    p.wait_for(r"world \d+: 2 worker\(s\); joined: hA-1-r1", 60)
    p.wait_for(r"^\[hA-1-r1\] step \d+ size 2$", 30, stream="out")
    p.finish()
    assert p.wait(90) == 0, p.text()
    # At start: the slot (the respawn keeps its slot), the host's slots, OMP as torchrun; no rank yet.
    for w, slot in (("hA-0", 0), ("hA-1", 1), ("hA-1-r1", 1)):
        p.wait_for(rf"^\[{w}\] env RANK=- WORLD_SIZE=- LOCAL_RANK={slot} LOCAL_WORLD_SIZE=2 OMP_NUM_THREADS=1 "
                   rf"MASTER_ADDR=-$", 1)
    # In every world RANK and WORLD_SIZE are that world's.
    worlds = re.findall(r"^\[\S+\] world env rank (\d) size (\d) RANK=(\S+) WORLD_SIZE=(\S+) ", "\n".join(p.stdout),
                        re.M)
    assert len(worlds) >= 5 and all((r, n) == (rr, nn) for r, n, rr, nn in worlds), p.text()
    assert {n for _, n, _, _ in worlds} == {"1", "2"}, worlds
    p.wait_for(r"^elastic-run: OMP_NUM_THREADS=1 for every worker, as torchrun sets it", 1)
    # The respawn waits on standby for the next commit, and says so (it is no hot spare).
    p.wait_for(r"^\[hA-1-r1\] INFO elastic: worker hA-1-r1 on standby: joins world \d+ at the next commit of world "
               r"\d+ \(1 of max_np=1024 in it\)$", 1)


def test_an_omp_num_threads_of_the_users_own_is_kept(launch):
    p = launch("--np", "2", "--host", "hA", LW_STEPS="4", LW_PRINT_ENV="1", OMP_NUM_THREADS="3")
    assert p.wait(60) == 0, p.text()
    assert sum(1 for l in p.stdout if " OMP_NUM_THREADS=3 " in l and l.split()[1] == "env") == 2, p.text()
    assert "OMP_NUM_THREADS=1" not in p.text()



def test_grpcs_own_lines_do_not_reach_the_user_and_the_runtimes_do_without_basicconfig(launch):
    # DataLoader workers fork while gRPC's threads run (fork_posix.cc used to say so at every fork).
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, EPOCH_JOB], EJ_LOADER_WORKERS="2")
    assert p.wait(120) == 0, p.text()
    assert not any(".cc:" in l for l in p.stderr), p.text()
    # The script configures no logging: the launcher asked the runtime for its INFO lines.
    p.wait_for(r"^\[hA-\d\] INFO elastic: worker hA-\d is rank 0 of 2 in world version 1", 1)


def test_a_worker_cut_off_and_back_prints_no_grpc_line(launch):
    # Stopped past the heartbeat timeout, it is evicted; woken, its channel meets the server's GOAWAY.
    p = launch("--np", "3", "--min-np", "2", "--host", "hA", LW_STEPS="400")
    p.wait_training(3)
    p.kill_worker("hA-2", signal.SIGSTOP)
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2", 30)
    p.kill_worker("hA-2", signal.SIGCONT)
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hA-2", 60)
    p.wait_for(r"^\[hA-2\] step \d+ size 3$", 30, stream="out")
    p.finish()
    assert p.wait(120) == 0, p.text()
    assert not any("chttp2_transport" in l or ".cc:" in l for l in p.stderr), p.text()


def test_quiet_prints_only_what_went_wrong_and_the_end(launch):
    p = launch("--np", "2", "--host", "hA", "--quiet", command=[sys.executable, EPOCH_JOB])
    assert p.wait(120) == 0, p.text()
    assert p.stderr == ["elastic-run: job default completed"], p.text()


def test_a_job_waiting_for_a_late_host_says_so(launch, server):
    srv, token = server
    args = ("--rendezvous", srv.address, "--job-id", "exp10", "--token-file", token)
    a = launch("--np", "1", "--min-np", "2", "--host", "hostA", *args, LW_STEPS="6")
    a.wait_for(r"^elastic-run: waiting for 1 more worker: 1 of min-np 2 joined, 1\d s \(the job fails after 600 s "
               r"below min-np\)$", 40)
    b = launch("--np", "1", "--host", "hostB", *args, LW_STEPS="6")
    assert a.wait(90) == 0 and b.wait(90) == 0, a.text() + b.text()
