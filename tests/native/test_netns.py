"""A mixed world across two network namespaces ("hosts", two ranks each): shared memory inside
a host, TCP over a veth link between them, the same bits on every rank."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and iproute2 to create network namespaces (CI has both)")]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    tag = f"{os.getpid() % 100000}"
    ns = (f"era{tag}", f"erb{tag}")
    veth = (f"vea{tag}", f"veb{tag}")
    # Addresses of our own namespaces, reachable only through this veth pair.
    addr = ("10.231.77.1", "10.231.77.2")
    try:
        for n in ns:
            _ip("netns", "add", n)
            _ip("-n", n, "link", "set", "lo", "up")
        _ip("link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
        for n, v, a in zip(ns, veth, addr):
            _ip("-n", n, "addr", "add", f"{a}/24", "dev", v)
            _ip("-n", n, "link", "set", v, "up")
        yield ns, addr
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=10)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "auto"])
def test_two_hosts_two_ranks_each_mix_shared_memory_and_tcp(two_hosts, algorithm):
    ns, addr = two_hosts
    # Ring order a0, a1, b0, b1: a0->a1 and b0->b1 stay on their host, a1->b0 and b1->a0 cross.
    places = [(ns[0], addr[0], 29611), (ns[0], addr[0], 29612), (ns[1], addr[1], 29613), (ns[1], addr[1], 29614)]
    peers = ",".join(f"{a}:{p}" for _, a, p in places)
    hosts = "host-a,host-a,host-b,host-b"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(["ip", "netns", "exec", n, sys.executable, os.path.join(HERE, "netns_worker.py"),
                               str(r), f"{a}:{p}", peers, hosts, algorithm], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, text=True)
             for r, (n, a, p) in enumerate(places)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r["links"] for r in results] == [["shm", "tcp"], ["tcp", "shm"], ["shm", "tcp"], ["tcp", "shm"]]
    assert all(r["ok"] for r in results), "a rank differs from numpy"
    assert all(r["digests"] == results[0]["digests"] for r in results), "ranks hold different bits"
    if algorithm == "ring":
        assert all(r["hierarchical_links"] == [[], []] and r["algorithms"] == ["ring"] for r in results)
    else:
        # Host mates over shared memory; the leaders (a0, b0) across the veth over TCP.
        assert [r["hierarchical_links"] for r in results] == [[["shm", "shm"], ["tcp", "tcp"]], [["shm", "shm"], []],
                                                              [["shm", "shm"], ["tcp", "tcp"]], [["shm", "shm"], []]]
        want = ["hierarchical"] if algorithm == "hierarchical" else ["hierarchical", "ring"]  # auto: 12 MB goes hierarchical
        assert all(r["algorithms"] == want for r in results), [r["algorithms"] for r in results]


def test_a_ring_link_that_drops_everything_fails_within_the_dead_link_timeout_not_the_collective_one(two_hosts):
    # Both ranks alive, their link dead (a veth taken down: no RST, no FIN). The collective
    # timeout is 600 s; the kernel gives up on data unacknowledged for the dead-link timeout
    # (TCP_USER_TIMEOUT; keepalive on the side that waits idle), set to 6 s here (default 30 s).
    dead_link = 6
    ns, addr = two_hosts
    peers = f"{addr[0]}:29621,{addr[1]}:29622"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(["ip", "netns", "exec", n, sys.executable, os.path.join(HERE, "netns_link_worker.py"),
                               str(r), f"{a}:{29621 + r}", peers, str(dead_link)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for r, (n, a) in enumerate(zip(ns, addr))]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "running", p.stderr.read()[-3000:]
        cut = time.monotonic()
        _ip("-n", ns[1], "link", "set", f"veb{ns[1][3:]}", "down")
        results = []
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    # Both give up, whether data was in flight or they waited idle (keepalive). What the kernel
    # says is its last error on the connection: the timeout itself, or the unreachable route
    # its retransmissions met.
    failed_after = [r["at"] - cut for r in results]
    # Retransmissions back off, so the kernel notices up to about twice the setting late.
    assert all(dead_link - 2 < t < 3 * dead_link for t in failed_after), (failed_after, results)
    assert all(r["reason"] == "peer_lost" and re.search(r"lost: (Connection timed out \(nothing sent on it was "
                                                        r"acknowledged for 6 s, CommConfig.dead_link_timeout|No route "
                                                        r"to host|Network is unreachable)", r["text"])
               for r in results), results
