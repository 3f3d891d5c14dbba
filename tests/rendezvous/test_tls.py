"""TLS between the rendezvous service and its clients: workers, the launcher, `status`.

A test CA (tests/certs.py) signs the server's certificate and the clients' ones; the server runs as
`elastic-rendezvous serve --token-file --tls-cert --tls-key --tls-client-ca`, the job as a real
`elastic-run --rendezvous … --tls-ca … --tls-cert … --tls-key …` with real worker processes.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import threading

import grpc
import pytest

from rendezvous.common.channel import RendezvousRPCError, channel_credentials
from rendezvous.server.server_config import ServerConfig
from tests.certs import make_pki

from .rdzv_helpers import REPO, ServerProc, child_env, make_client, unique, wait_world_of

TOKEN = "tls-test-token-5b0d1e"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture
def tls_server(tmp_path, pki, token_file):
    """A server that wants a token and a client certificate signed by the test CA."""
    server = ServerProc(tmp_path, "--token-file", token_file, "--tls-cert", pki.server_cert,
                        "--tls-key", pki.server_key, "--tls-client-ca", pki.ca)
    yield server
    server.kill()


def status(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "rendezvous", "status", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_worker_job_runs_over_tls_and_status_prints_its_table(tls_server, pki, token_file, tmp_path):
    from tests.launch.launch_helpers import LaunchProc

    job = unique("tlsjob")
    p = LaunchProc(tmp_path, "--np", "2", "--host", "hT", "--rendezvous", tls_server.address, "--job-id", job,
                   "--token-file", token_file, "--tls-ca", pki.ca, "--tls-cert", pki.client_cert,
                   "--tls-key", pki.client_key, LW_STEPS="60")
    try:
        p.wait_training(2, timeout=60)
        out = status("--server", tls_server.address, "--job", job, "--token-file", token_file,
                     "--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key)
        assert out.returncode == 0, out.stderr
        assert f"job {job}  phase RUNNING  world 1  np 2..1024" in out.stdout, out.stdout
        rows = sorted(line.split()[1:3] for line in out.stdout.splitlines() if " hT " in line)
        assert rows == [["hT-0", "hT"], ["hT-1", "hT"]], out.stdout
        assert p.wait(90) == 0, p.text()
        assert p.stderr[-1] == f"elastic-run: job {job} completed", p.text()
        assert sum(1 for line in p.stdout if line.endswith("] done")) == 2, p.text()
    finally:
        p.close()


@pytest.mark.slow
def test_status_without_a_client_certificate_is_refused(tls_server, pki, token_file):
    out = status("--server", tls_server.address, "--token-file", token_file, "--tls-ca", pki.ca, "--timeout", "3")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr, out.stderr
    plain = status("--server", tls_server.address, "--token-file", token_file, "--timeout", "3")
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain.stderr


@pytest.mark.slow
@pytest.mark.parametrize("who", ["no TLS", "no client certificate", "another CA's client certificate",
                                 "trusting another CA"])
def test_a_client_the_server_cannot_verify_or_that_cannot_verify_it_is_refused(who, tls_server, pki, tmp_path):
    other = make_pki(str(tmp_path / "other"))
    creds = {"no TLS": None,
             "no client certificate": channel_credentials(pki.ca),
             "another CA's client certificate": channel_credentials(pki.ca, other.client_cert, other.client_key),
             "trusting another CA": channel_credentials(other.ca, pki.client_cert, pki.client_key)}[who]
    job = unique("job")
    c = make_client([tls_server.address], "w0", job_id=job, token=TOKEN, credentials=creds)
    with pytest.raises(RendezvousRPCError) as e:
        c.join(timeout_s=1.5)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    c.close()
    # The same server takes a client with the CA and a certificate it signed.
    good = make_client([tls_server.address], "w0", job_id=job, token=TOKEN,
                       credentials=channel_credentials(pki.ca, pki.client_cert, pki.client_key))
    good.join(timeout_s=10)
    assert wait_world_of([good], 1)[0].size == 1
    good.close()


@pytest.mark.slow
def test_a_worker_configured_for_tls_never_sends_its_token_in_clear_text(pki, tmp_path):
    """A plaintext listener where the server should be (a spoofed address, a port taken over): the
    worker speaks only TLS to it, so it sees a TLS ClientHello and never the token."""
    from elastic.runtime.worker_config import WorkerConfig

    cfg = WorkerConfig.from_env({"ELASTIC_RENDEZVOUS": "127.0.0.1:1", "ELASTIC_TOKEN": TOKEN,
                                 "ELASTIC_TLS_CA": pki.ca, "ELASTIC_TLS_CERT": pki.client_cert,
                                 "ELASTIC_TLS_KEY": pki.client_key})
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(10)
    received = bytearray()

    def capture():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(3)
            try:
                while len(received) < 65536:
                    data = conn.recv(4096)
                    if not data:
                        return
                    received.extend(data)
            except OSError:
                return

    t = threading.Thread(target=capture, daemon=True)
    t.start()
    c = make_client([f"127.0.0.1:{listener.getsockname()[1]}"], "w0", token=cfg.token,
                    credentials=cfg.channel_credentials())
    with pytest.raises(RendezvousRPCError):
        c.join(timeout_s=1.5)
    c.close()
    listener.close()
    t.join(10)
    assert received[:1] == b"\x16", bytes(received[:16])        # a TLS handshake record
    assert TOKEN.encode() not in received and b"authorization" not in received


@pytest.mark.parametrize("env,message", [
    ({"ELASTIC_TLS_CA": "/nonexistent/ca.pem"}, "cannot read ELASTIC_TLS_CA /nonexistent/ca.pem: No such file"),
    ({"ELASTIC_TLS_CERT": "c.pem", "ELASTIC_TLS_KEY": "k.pem"}, "ELASTIC_TLS_CERT needs ELASTIC_TLS_CA"),
    ({"ELASTIC_TLS_CA": "{ca}", "ELASTIC_TLS_CERT": "{cert}"},
     "ELASTIC_TLS_CERT and ELASTIC_TLS_KEY must be given together"),
    ({"ELASTIC_TLS_CA": "{token}"}, "ELASTIC_TLS_CA {token} is not a PEM file"),
])
def test_a_worker_with_unusable_tls_files_fails_at_start_naming_the_variable(env, message, pki, token_file):
    from elastic.runtime.worker_config import WorkerConfig

    fill = dict(ca=pki.ca, cert=pki.client_cert, token=token_file)
    env = {k: v.format(**fill) for k, v in env.items()}
    with pytest.raises(ValueError, match=message.format(**fill)):
        WorkerConfig.from_env({"ELASTIC_RENDEZVOUS": "127.0.0.1:29400", **env})


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--tls-ca", "/nonexistent/ca.pem"], "cannot read --tls-ca /nonexistent/ca.pem"),
    (["--tls-ca", "{ca}", "--tls-cert", "{cert}"], "--tls-cert and --tls-key must be given together"),
    (["--tls-key", "{key}"], "--tls-key needs --tls-ca"),
])
def test_elastic_run_refuses_unusable_tls_flags_naming_them(args, message, pki, tmp_path):
    fill = dict(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    args = [a.format(**fill) for a in args]
    done = subprocess.run([sys.executable, "-m", "elastic.launch", "--rendezvous", "127.0.0.1:29400",
                           "--job-id", "j", *args, "--", sys.executable, "-c", "pass"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


@pytest.mark.parametrize("args,message", [
    (["--insecure", "--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert/--tls-key"),
    (["--insecure", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "cannot read --tls-key /nonexistent/k.pem"),
])
def test_serve_refuses_unusable_tls_flags_naming_them(args, message):
    from rendezvous.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *args])
    assert message in str(e.value.code)


@pytest.mark.parametrize("host,insecure,token,tls,warned", [
    ("0.0.0.0", True, None, False, "anyone who can reach this address can join jobs"),
    ("10.1.2.3", True, None, True, "anyone who can reach this address can join jobs"),
    ("::", True, None, False, "anyone who can reach this address can join jobs"),
    ("0.0.0.0", False, "t", False, "the token crosses the network in clear text"),
    ("0.0.0.0", False, "t", True, None),
    ("127.0.0.1", True, None, False, None),
    ("::1", True, None, False, None),
    ("localhost", True, None, False, None),
])
def test_exposure_warning(host, insecure, token, tls, warned):
    cfg = ServerConfig(host=host, insecure=insecure, token=token, tls_cert="c" if tls else None,
                       tls_key="k" if tls else None)
    warning = cfg.exposure_warning()
    assert (warning is None) if warned is None else (warned in warning)


@pytest.mark.slow
def test_insecure_on_a_non_loopback_address_prints_one_warning(tmp_path):
    server = ServerProc(tmp_path, "--insecure", "--host", "0.0.0.0")
    try:
        lines = [line for line in server.log().splitlines() if "WARNING" in line]
        assert len(lines) == 1, server.log()
        assert "--insecure on 0.0.0.0: anyone who can reach this address can join jobs" in lines[0]
    finally:
        server.kill()
    local = ServerProc(tmp_path, "--insecure")    # 127.0.0.1: only this machine
    try:
        assert "WARNING" not in local.log(), local.log()
    finally:
        local.kill()



@pytest.mark.slow
def test_elastic_run_warns_when_its_token_would_cross_the_network_in_clear_text(token_file):
    done = subprocess.run([sys.executable, "-m", "elastic.launch", "--rendezvous", "192.0.2.1:29400",
                           "--job-id", "j", "--token-file", token_file, "--connect-timeout", "1",
                           "--", sys.executable, "-c", "pass"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert ("elastic-run: warning: the rendezvous token goes to 192.0.2.1:29400 in clear text; give --tls-ca"
            in done.stderr), done.stderr


@pytest.mark.parametrize("text,result", [
    ("a:1", ("a:1",)),
    (" a:1 , [::1]:29400 ,", ("a:1", "[::1]:29400")),
    ("a", "'a' is not HOST:PORT"),
    (":80", "':80' is not HOST:PORT"),
    ("a:0", "'a:0' is not HOST:PORT"),
    ("a:65536", "'a:65536' is not HOST:PORT"),
    ("a:x", "'a:x' is not HOST:PORT"),
    (" , ", "needs HOST:PORT"),
])
def test_parse_addresses(text, result):
    from rendezvous.common.channel import parse_addresses

    if isinstance(result, tuple):
        assert parse_addresses(text, "--x") == result
    else:
        with pytest.raises(ValueError, match=result.replace("[", r"\[")):
            parse_addresses(text, "--x")


@pytest.mark.parametrize("content,result", [
    (b"tok-1\n", "tok-1"),
    (b"  spaced token \r\n", "spaced token"),
    (b"\n\n", "is empty"),
    (b"t\x00k", "printable ASCII"),
    ("tökén".encode(), "printable ASCII"),
    (b"t" * 5000, "printable ASCII"),
])
def test_read_token_file(content, result, tmp_path):
    from rendezvous.common.channel import read_token_file

    path = tmp_path / "token"
    path.write_bytes(content)
    if result.startswith("tok") or result.startswith("spaced"):
        assert read_token_file(str(path), "--token-file") == result
    else:
        with pytest.raises(ValueError, match=f"--token-file {path} .*{result}"):
            read_token_file(str(path), "--token-file")
