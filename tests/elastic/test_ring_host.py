"""Which ring address a worker announces, and when it refuses to start (elastic.runtime.worker_config.ring_host_for).

A worker whose host name resolves to a loopback address (Debian's /etc/hosts maps it to
127.0.1.1) would announce an address no other host can reach; in a job that may span hosts
it is stopped at start with one line naming ELASTIC_RING_HOST, instead of a ring that waits
for its form timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from elastic.runtime.worker_config import WorkerConfig, ring_host_for

from .jobs import JOB, REPO

LOOPBACK_RDZV = ("127.0.0.1:29400",)
REMOTE_RDZV = ("10.1.2.3:29400",)


def resolves_to(address):
    return lambda: ("node7", address)


def never_called():
    raise AssertionError("the host name must not be resolved when the decision does not need it")


@pytest.mark.parametrize("explicit,rendezvous,resolve,expect", [
    # ELASTIC_RING_HOST always wins, loopback or not: the operator said so.
    ("10.0.0.5", REMOTE_RDZV, never_called, "10.0.0.5"),
    ("127.0.0.1", REMOTE_RDZV, never_called, "127.0.0.1"),
    ("127.0.1.1", ("rdzv.example:29400",), never_called, "127.0.1.1"),
    # Every rendezvous address on loopback: a single-host job.
    ("", LOOPBACK_RDZV, never_called, "127.0.0.1"),
    ("", ("localhost:29400", "[::1]:29401"), never_called, "127.0.0.1"),
    # Else the host's own address, when it is routable.
    ("", REMOTE_RDZV, resolves_to("10.0.0.7"), "10.0.0.7"),
    ("", ("rdzv.example:29400",), resolves_to("192.168.1.20"), "192.168.1.20"),
    ("", ("127.0.0.1:29400", "10.1.2.3:29400"), resolves_to("10.0.0.7"), "10.0.0.7"),
])
def test_the_ring_host_decision(explicit, rendezvous, resolve, expect):
    assert ring_host_for(explicit, rendezvous, resolve) == expect


@pytest.mark.parametrize("rendezvous,resolve,says", [
    (REMOTE_RDZV, resolves_to("127.0.1.1"), "resolves to 127.0.1.1, a loopback address"),
    (("rdzv.example:29400",), resolves_to("127.0.0.1"), "resolves to 127.0.0.1, a loopback address"),
    (("127.0.0.1:29400", "10.1.2.3:29400"), resolves_to("::1"), "resolves to ::1"),
    (REMOTE_RDZV, resolves_to(""), "does not resolve"),
])
def test_a_loopback_or_unresolvable_host_address_in_a_job_that_may_span_hosts_stops_the_worker(
        rendezvous, resolve, says):
    with pytest.raises(ValueError) as info:
        ring_host_for("", rendezvous, resolve)
    text = str(info.value)
    assert "ELASTIC_RING_HOST" in text and says in text and "'node7'" in text, text
    assert "\n" not in text


def test_from_env_reads_the_decision():
    env = {"ELASTIC_RENDEZVOUS": "127.0.0.1:29400"}
    assert WorkerConfig.from_env(env).ring_host == "127.0.0.1"
    assert WorkerConfig.from_env({**env, "ELASTIC_RING_HOST": "10.9.8.7"}).ring_host == "10.9.8.7"


def _host_resolves_to_loopback() -> bool:
    try:
        return socket.gethostbyname(socket.gethostname()).startswith("127.")
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not _host_resolves_to_loopback(), reason="this host's name resolves to a routable address")
def test_a_real_worker_on_a_host_named_for_loopback_stops_at_start_naming_elastic_ring_host(tmp_path):
    # The rendezvous is a documentation address (nobody there): the worker must stop before it
    # tries to reach it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(PYTHONPATH=REPO, ELASTIC_RENDEZVOUS="192.0.2.1:29400", ELASTIC_WORKER_ID="w0", JOB_OUT=str(tmp_path))
    proc = subprocess.run([sys.executable, JOB], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ELASTIC_RING_HOST is not set and this host's name"), proc.stderr
    assert "a loopback address" in last or "does not resolve" in last, last
