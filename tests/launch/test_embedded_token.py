"""The embedded rendezvous server of `elastic-run` wants a random token only its own workers get.

Other users of the machine reach 127.0.0.1 too; the token lives in a 0600 file in a 0700 directory
that is gone when the launcher exits. Real launcher, real server, real worker processes.
"""

from __future__ import annotations

import os
import stat
import sys

import grpc
import pytest

from rendezvous.common.channel import RendezvousRPCError
from rendezvous.wire.membership import JobSpec
from rendezvous.client.status_client import StatusClient, StatusError
from rendezvous.client.worker_client import RendezvousClient

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane


def worker_environ(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in items}


def status_code(address: str, token=None):
    with StatusClient([address], token) as status:
        try:
            status.job("default", timeout_s=5)
        except StatusError as e:
            return e.code
    return grpc.StatusCode.OK


def test_the_embedded_server_wants_a_private_random_token_while_the_job_runs(launch):
    p = launch("--np", "2", "--host", "hA", LW_STEPS="100000", LW_SLEEP="0.02")
    address = p.wait_for(r"rendezvous server for job default on (127\.0\.0\.1:\d+) \(embedded\)", 30).group(1)
    p.wait_training(2, timeout=60)

    env = worker_environ(p.worker_pid("hA-0"))
    assert "ELASTIC_TOKEN" not in env
    token_file = env["ELASTIC_TOKEN_FILE"]
    assert worker_environ(p.worker_pid("hA-1"))["ELASTIC_TOKEN_FILE"] == token_file
    directory = os.path.dirname(token_file)
    for path, mode in ((token_file, 0o600), (directory, 0o700)):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == mode, (path, oct(st.st_mode))
        assert st.st_uid == os.getuid()
    token = open(token_file).read().strip()
    assert len(token) >= 32          # secrets.token_urlsafe(32): 256 bits, 43 characters

    # A local stranger without the token gets nothing: no status, no join.
    assert status_code(address) == grpc.StatusCode.UNAUTHENTICATED
    assert status_code(address, token="default") == grpc.StatusCode.UNAUTHENTICATED
    stranger = RendezvousClient([address], job_id="default", worker_id="intruder", host="evil",
                                ring_address="127.0.0.1:1", spec=JobSpec(min_np=1, max_np=8))
    with pytest.raises(RendezvousRPCError) as e:
        stranger.join(timeout_s=5)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    stranger.close()
    assert status_code(address, token=token) == grpc.StatusCode.OK

    p.proc.terminate()
    assert p.wait(60) == 128 + 15, p.text()
    assert not os.path.exists(directory), "the token's directory must go with the launcher"


def test_a_token_in_the_launchers_environment_does_not_override_the_embedded_one(launch):
    p = launch("--np", "2", "--host", "hA", LW_STEPS="6", ELASTIC_TOKEN="some-other-servers-token")
    assert p.wait(90) == 0, p.text()
    assert p.stderr[-1] == "elastic-run: job default completed", p.text()


@pytest.mark.parametrize("flags,message", [
    (["--tls-ca", "ca.pem"], "--tls-ca needs --rendezvous"),
    (["--token-file", "token"], "--token-file needs --rendezvous"),
])
def test_flags_for_a_remote_server_are_refused_with_the_embedded_one(launch, flags, message):
    p = launch("--np", "1", *flags, command=[sys.executable, "-c", "pass"])
    assert p.wait(30) == 2, p.text()
    assert message in p.text()

