"""A child forked from a worker lets go of the worker's connections to the rendezvous (elastic/runtime/fork_guard.py)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from elastic.runtime import fork_guard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("host, port, key", [
    ("127.0.0.1", 7000, ("127.0.0.1", 7000)),
    ("::ffff:127.0.0.1", 7000, ("127.0.0.1", 7000)),      # IPv4-mapped, as a dual-stack socket names it
    ("::1", 29400, ("::1", 29400)),
    ("fe80::1%eth0", 1, ("fe80::1", 1)),                    # the zone is no part of the address
    ("0:0:0:0:0:0:0:1", 5, ("::1", 5)),                     # one spelling
    ("rendezvous.example", 7000, None),                     # a name is resolved before, never compared
    ("", 7000, None),
])
def test_peer_key(host, port, key):
    assert fork_guard.peer_key(host, port) == key


HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(local: str, remote: str, inode: str) -> str:
    return f"   0: {local} {remote} 01 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0 20 4 30 10 -1\n"


# Tables as a little-endian kernel prints them: each 32-bit word of an address as a number.
@pytest.mark.parametrize("table, found", [
    (row("0100007F:D6A4", "0100007F:1F90", "4711"), {4711: ("127.0.0.1", 8080)}),
    (row("0100007F:1F90", "00000000:0000", "12"), {}),                                   # listening
    (row("00000000000000000000000001000000:D6A4", "00000000000000000000000001000000:72D8", "9"),
     {9: ("::1", 29400)}),
    (row("0000000000000000FFFF00000100007F:D6A4", "0000000000000000FFFF00000100007F:1F90", "10"),
     {10: ("127.0.0.1", 8080)}),                                                         # IPv4-mapped
    (row("0100007F:D6A4", "0100007F:1F90", "0"), {}),                                    # no inode (time-wait)
    (row("0100007F:D6A4", "0100007F:1F9", "5") + row("0100007F:D6A4", "ZZ00007F:1F90", "6")
     + "   0: truncated\n", {}),                                                           # malformed
    (row("0100007F:D6A4", "0100007F:1F90", "1") + row("0100007F:D6A5", "0200007F:1F91", "2"),
     {1: ("127.0.0.1", 8080), 2: ("127.0.0.2", 8081)}),
])
def test_connections_are_read_from_the_kernels_table(table, found):
    assert fork_guard.connections(HEADER + table, "little") == found


def test_a_big_endian_table_reads_the_same_addresses():
    assert fork_guard.connections(HEADER + row("7F000001:D6A4", "7F000001:1F90", "3"), "big") == {
        3: ("127.0.0.1", 8080)}


def _wait_eof(conn: socket.socket, timeout: float) -> bool:
    conn.settimeout(timeout)
    try:
        return conn.recv(1) == b""
    except socket.timeout:
        return False


def scenario() -> None:
    """Run in a fresh interpreter (a fork of the test process could meet gRPC's fork handlers):
    a worker connected to a rendezvous server and to something else forks a child that lingers."""
    rendezvous, other = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    to_rendezvous = socket.create_connection(rendezvous.getsockname())
    to_other = socket.create_connection(other.getsockname())   # blocking, as a multiprocessing pipe is
    served, _ = rendezvous.accept()
    other_served, _ = other.accept()
    fork_guard.guard_rendezvous([f"localhost:{rendezvous.getsockname()[1]}"])
    # As download code sets it: looking at the inherited sockets must not make them non-blocking
    # (the open file is the worker's too).
    socket.setdefaulttimeout(5)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: what it holds now, then it lingers (as a DataLoader worker would)
        try:
            null = os.stat(os.devnull).st_rdev
            st = os.fstat(to_rendezvous.fileno())
            kept = stat.S_ISSOCK(os.fstat(to_other.fileno()).st_mode)
            os.write(write_end, b"%d%d" % (stat.S_ISCHR(st.st_mode) and st.st_rdev == null, kept))
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        assert os.read(read_end, 2) == b"11", "the child's copy is /dev/null; its other socket is untouched"
        assert os.get_blocking(to_other.fileno()), "the worker's blocking socket stays blocking"
        # The worker closes (or dies): the server sees the end at once, though the child lives on.
        to_rendezvous.close()
        assert _wait_eof(served, 10), "the rendezvous connection stayed open in the forked child"
        to_other.close()
        assert not _wait_eof(other_served, 0.5), "a connection to anything else stays the child's too"
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the child lives on"
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    print("scenario passed", flush=True)


@pytest.mark.slow
def test_a_forked_child_lets_go_of_the_rendezvous_connection_and_keeps_its_others():
    done = subprocess.run([sys.executable, "-c", "from tests.elastic.test_fork_guard import scenario; scenario()"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "scenario passed" in done.stdout, done.stdout + done.stderr
