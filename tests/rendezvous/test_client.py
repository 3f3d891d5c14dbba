"""The worker-side client: failover across addresses, deadlines, TLS."""
from __future__ import annotations

import subprocess
import time

import grpc
import pytest

from rdzv_helpers import ServerThread, make_client, server_config, unique, wait_world_of
from rendezvous.cli import main
from rendezvous.client import JobSpec, RendezvousError
from rendezvous.etcd_process import free_port
from rendezvous.store import MemoryStore


@pytest.fixture(scope="module")
def server():
    s = ServerThread(server_config(), MemoryStore)
    yield s
    s.stop()


def test_dead_address_is_skipped_for_the_next_one(server):
    dead = f"127.0.0.1:{free_port()}"
    job = unique("job")
    c = make_client([dead, server.address], "w0", job_id=job)
    c.join(timeout_s=10)
    assert wait_world_of([c], 1)[0].version == 1
    assert c.heartbeat(committed_step=3) == 1
    c.close()


def test_no_reachable_server_fails_within_the_deadline_naming_addresses():
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    c = make_client(dead, "w0", job_id=unique("job"))
    start = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        c.join(timeout_s=1.0)
    assert time.monotonic() - start < 5.0
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and dead[0] in str(e.value)
    c.close()


def test_wait_world_times_out_with_job_and_worker_named(server):
    job = unique("job")
    c = make_client(server.address, "lonely", job_id=job, spec=JobSpec(min_np=2, max_np=2))
    c.join()
    with pytest.raises(TimeoutError, match=f"job {job} worker lonely"):
        c.wait_world(timeout_s=0.3)
    c.close()


def test_calls_before_join_are_refused_clearly(server):
    c = make_client(server.address, "early", job_id=unique("job"))
    with pytest.raises(RendezvousError, match="join\\(\\) first"):
        c.heartbeat(1)
    c.close()


def test_tls_server_accepts_tls_clients_and_refuses_plaintext(tmp_path, capsys):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    s = ServerThread(server_config(tls_cert=str(cert), tls_key=str(key)), MemoryStore)
    try:
        job = unique("job")
        address = f"localhost:{s.port}"
        c = make_client(address, "w0", job_id=job, tls_root_cert=cert.read_bytes())
        c.join(timeout_s=10)
        assert wait_world_of([c], 1)[0].size == 1
        plain = make_client(address, "w1", job_id=job)
        with pytest.raises(RendezvousError) as e:
            plain.join(timeout_s=1.0)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert main(["status", "--server", address, "--tls-ca", str(cert), "--job", job]) == 0
        assert f"job {job}  phase RUNNING  world 1" in capsys.readouterr().out
        c.close()
        plain.close()
    finally:
        s.stop()
