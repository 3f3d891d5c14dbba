"""Fixtures for the rendezvous tests: a real etcd on free loopback ports, store factories, servers."""
from __future__ import annotations

import uuid

import grpc
import pytest

from rendezvous.server.etcd_process import EtcdProcess
from rendezvous.server.store import EtcdStore, MemoryStore

from .rdzv_helpers import ServerThread, WorkerProc, make_client, server_config


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """One etcd member for the whole session; tests isolate themselves by key prefix / job id."""
    proc = EtcdProcess(str(tmp_path_factory.mktemp("etcd")))
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory):
    """One etcd member that serves TLS, requires client certificates, and has auth enabled: a root
    user and user `rdzv` (password `rdzv_password`, in `rdzv_password_file`) that may read and
    write keys under /t/ only. `pki` is the test CA; its client certificate (CN elastic-client,
    not an etcd user) opens the connection but grants nothing without a password."""
    import secrets

    from rendezvous.server.etcd_process import EtcdTls
    from tests.certs import make_pki

    pki = make_pki(str(tmp_path_factory.mktemp("etcd-pki")))
    proc = EtcdProcess(str(tmp_path_factory.mktemp("etcd-secure")),
                       tls=EtcdTls(ca=pki.ca, server_cert=pki.server_cert, server_key=pki.server_key,
                                   client_cert=pki.client_cert, client_key=pki.client_key))
    proc.pki = pki
    proc.rdzv_password = secrets.token_urlsafe(16)
    proc.rdzv_password_file = str(tmp_path_factory.mktemp("etcd-secrets") / "rdzv-password")
    with open(proc.rdzv_password_file, "w") as f:
        f.write(proc.rdzv_password + "\n")
    try:
        proc.add_user("rdzv", proc.rdzv_password, "/t/")
        proc.enable_auth(secrets.token_urlsafe(16))
    except BaseException:
        proc.stop()
        raise
    yield proc
    proc.stop()


@pytest.fixture(params=["memory", "etcd"])
def store_kind(request):
    return request.param


@pytest.fixture
def make_store(store_kind, request):
    """A zero-argument factory for a fresh store of the parametrized kind (call it inside the loop)."""
    if store_kind == "etcd":
        endpoint = request.getfixturevalue("etcd").endpoint
        return lambda: EtcdStore([endpoint])
    return MemoryStore


@pytest.fixture
def prefix():
    """A key prefix unique to the test, so tests sharing one etcd never see each other's keys."""
    return f"/t/{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def serve(make_store):
    """Start servers on the parametrized store kind: `serve(**config_overrides) -> ServerThread`."""
    started = []

    def start(**kw):
        s = ServerThread(server_config(**kw), make_store)
        started.append(s)
        return s

    yield start
    for s in started:
        losses = s.service.leadership_losses
        s.stop()
        assert losses == 0, "the only replica must never lose leadership (clients would hide it)"


@pytest.fixture
def client():
    """client(address, worker_id, **kw) -> a RendezvousClient (rdzv_helpers.make_client), closed
    when the test ends however it ends: a failed assert leaks no watch thread. (List it after
    `serve`, so clients close before their server stops.)"""
    made = []

    def make(*args, **kw):
        c = make_client(*args, **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


@pytest.fixture
def stub():
    """stub(server) -> a bare Rendezvous stub for raw RPCs, on a plaintext channel to the server
    (one per server), closed when the test ends (which cancels its open calls)."""
    from rendezvous.wire.messages import pb_grpc

    channels = {}

    def make(server):
        if server.address not in channels:
            channels[server.address] = grpc.insecure_channel(server.address)
        return pb_grpc.RendezvousStub(channels[server.address])
    yield make
    for ch in channels.values():
        ch.close()


@pytest.fixture
def workers():
    """workers(*args, **kw) -> a running WorkerProc (tests/rendezvous/worker_proc.py); all are killed after."""
    procs = []

    def start(*args, **kw):
        p = WorkerProc(*args, **kw)
        procs.append(p)
        return p
    yield start
    for p in procs:
        p.kill()
