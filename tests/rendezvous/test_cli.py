"""`elastic-rendezvous` command line: help, argument errors, serve + status as real processes."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from rendezvous.cli import main

from .rdzv_helpers import REPO, ServerProc, child_env, join_world, make_client, unique, wait_world_of


def test_serve_help_documents_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--port", "--etcd", "--token-file", "--insecure", "--tls-cert", "--tls-key",
                 "--heartbeat-timeout", "--settle", "--settle-max", "SIGTERM"):
        assert flag in out, flag


def test_serve_requires_a_token_or_insecure(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve"])
    assert e.value.code == 2 and "--token-file" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--insecure", "--etcd", "nohost"], "--etcd: 'nohost' is not HOST:PORT"),
    (["--insecure", "--port", "70000"], "--port 70000 is outside"),
    (["--insecure", "--tls-cert", "c.pem"], "--tls-cert and --tls-key must be given together"),
    (["--insecure", "--heartbeat-timeout", "0.1"], "heartbeat timeout"),
    (["--token-file", "/nonexistent/token"], "cannot read token file /nonexistent/token"),
])
def test_serve_rejects_bad_arguments_with_a_clear_message(args, message):
    with pytest.raises(SystemExit) as e:
        main(["serve", *args])
    assert message in str(e.value.code)


def test_serve_flags_left_out_mean_the_server_configs_defaults():
    from rendezvous.cli import parser, config_from_args
    from rendezvous.server.server_config import ServerConfig

    got, want = config_from_args(parser().parse_args(["serve", "--insecure"])), ServerConfig(insecure=True)
    for field in ("host", "port", "etcd_prefix", "heartbeat_timeout_s", "leader_ttl_s", "settle_s",
                  "settle_max_s", "default_elastic_timeout_s", "blacklist_after", "cooldown_min_s",
                  "cooldown_max_s", "advertise_address"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.decision() == want.decision()


@pytest.mark.parametrize("args, settle_max", [
    ([], 2.0),                                  # 10 x the default settle of 0.2 s, at least 2 s
    (["--settle", "0.5"], 5.0),                 # follows --settle
    (["--settle", "0.5", "--settle-max", "1"], 1.0),
])
def test_settle_max_follows_settle_unless_given(args, settle_max):
    from rendezvous.cli import parser, config_from_args

    cfg = config_from_args(parser().parse_args(["serve", "--insecure", *args]))
    assert cfg.decision().settle_max_s == settle_max


def test_a_settle_max_below_settle_is_refused():
    with pytest.raises(SystemExit) as e:
        main(["serve", "--insecure", "--settle", "1", "--settle-max", "0.5"])
    assert "settle max" in str(e.value.code)


def test_empty_token_file_is_rejected(tmp_path):
    f = tmp_path / "token"
    f.write_text("\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--token-file", str(f)])
    assert "is empty" in str(e.value.code)


@pytest.mark.slow
def test_status_prints_a_table_of_the_job(tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    server = ServerProc(tmp_path, "--token-file", str(token))
    try:
        job = unique("job")
        cs = [make_client([server.address], f"w{i}", job_id=job, host="nodeA", token="tok-123")
              for i in range(2)]
        v = join_world(cs)
        out = subprocess.run([sys.executable, "-m", "rendezvous", "status", "--server",
                              server.address, "--token-file", str(token)], cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"job {job}  phase RUNNING  world {v}  np 1..8" in out.stdout
        rows = [line.split() for line in out.stdout.splitlines() if "nodeA" in line]
        assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("0", "w0", "nodeA", "0/2"),
                                                            ("1", "w1", "nodeA", "1/2")]
        denied = subprocess.run([sys.executable, "-m", "rendezvous", "status", "--server",
                                 server.address], cwd=REPO, env=child_env(), capture_output=True,
                                text=True, timeout=30)
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
        assert "pass the job's token with --token-file F (or ELASTIC_TOKEN_FILE)" in denied.stderr, denied.stderr
        for c in cs:
            c.close()
        server.signal(signal.SIGTERM)
        assert server.wait(10) == 0
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path, host):
    # The port is held by another rendezvous server, as when one is already running there.
    first = ServerProc(tmp_path, "--insecure")
    try:
        done = subprocess.run([sys.executable, "-m", "rendezvous", "serve", "--insecure", "--host", host,
                               "--port", str(first.port)], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            f"elastic-rendezvous: --port {first.port}: {host}:{first.port} is already in use"], done.stderr
        assert first.proc.poll() is None
    finally:
        first.kill()


@pytest.mark.slow
def test_status_takes_the_server_list_elastic_run_takes(tmp_path):
    # The first address is down (a failed-over replica): the next one answers.
    server = ServerProc(tmp_path, "--insecure")
    try:
        job = unique("job")
        c = make_client([server.address], "w0", job_id=job, host="nodeA")
        c.join()
        wait_world_of([c], 1)
        out = subprocess.run([sys.executable, "-m", "rendezvous", "status", "--server",
                              f"127.0.0.1:1,{server.address}", "--job", job], cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"job {job}  phase RUNNING  world 1" in out.stdout
        c.close()
    finally:
        server.kill()
