"""Formation survives a flood: junk connections on every ring port while a ring forms and steps.

Loopback only and bounded: about 200 connections a second on each of three ring ports for a
few seconds — silent ones (held open), garbage, and HELLOs with a wrong proof whose claimed
job id is an escape sequence. The ring must form and run its allreduces; every dropped or
refused stray may cost a line on stderr only within the rate limit, and no escape code from
a peer may reach stderr.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

import elastic

from tests.waiting import wait_until

from . import wire
from .harness import World
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

RANKS = 3
RATE = 200          # junk connections per second per ring port
FLOOD_S = 6.0       # the flood lasts at most this long
HELD = 200          # silent connections held open per port: more than the 128 a listener keeps pending
EVIL_JOB = b"\x1b[2J\x1b[31mpwned\x07\nelastic-ring: forged line"
# What the rate limit allows: per listener, 5 refusal lines and one summary line a second.
LINES_PER_LISTENER_SECOND = 6


def _hello_with_bad_proof(version: int) -> bytes:
    return wire.msg(wire.HELLO, wire.hello_body(EVIL_JOB, version, 0, 1, RANKS)) + wire.msg(wire.PROOF, bytes(32))


class Flood:
    """Paces junk connections at RATE per port over every address until stopped or FLOOD_S is over."""

    def __init__(self, addresses):
        self.targets = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in addresses)]
        self.stop = threading.Event()
        self.opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def _run(self):
        held = [[] for _ in self.targets]
        junk = [None, b"GET / HTTP/1.1\r\nHost: ring\r\n\r\n", None, _hello_with_bad_proof(2)]
        start = time.monotonic()
        n = 0
        try:
            while not self.stop.is_set() and time.monotonic() - start < FLOOD_S:
                for port, target in enumerate(self.targets):
                    what = junk[n % len(junk)]
                    try:
                        s = socket.create_connection(target, timeout=1)
                    except OSError:
                        continue
                    self.opened += 1
                    if what is None:  # silent: held open, the oldest let go beyond HELD
                        held[port].append(s)
                        if len(held[port]) > HELD:
                            held[port].pop(0).close()
                        continue
                    try:
                        s.sendall(what)
                    except OSError:
                        pass
                    s.close()
                n += 1
                # Pace, not a wait for a condition: the n-th round is due at n / RATE seconds.
                ahead = start + n / RATE - time.monotonic()
                if ahead > 0:
                    self.stop.wait(ahead)
        finally:
            for port in held:
                for s in port:
                    s.close()

    def finish(self):
        self.stop.set()
        self.thread.join(10)


def _form_and_step_under_the_flood(comm, conn):
    conn.send(("ready", None))
    if not conn.poll(60):
        raise TimeoutError("parent never said go")
    peers = conn.recv()
    listener, rank, hosts = comm.listener, comm.rank, comm.hosts
    comm.close()
    started = time.monotonic()
    ring = elastic.Communicator.form(listener=listener, job_id="test-job", secret=b"test-secret", world_version=2,
                                     rank=rank, peers=peers, hosts=hosts,
                                     config=elastic.CommConfig(form_timeout=30, timeout=30))
    formed_in = time.monotonic() - started
    wrong, steps = [], 0
    with ring:
        while True:  # until the parent says stop (the flood is over); every rank agrees when
            buf = np.full(50_000, float(rank + steps), dtype=np.float32)
            ring.allreduce_(buf, elastic.Sum)
            if not np.all(buf == sum(r + steps for r in range(ring.size))):
                wrong.append(steps)
            steps += 1
            stop = np.array([1.0 if conn.poll(0) else 0.0], dtype=np.float32)
            ring.allreduce_(stop, elastic.Max)
            if stop[0]:
                break
    return formed_in, steps, wrong, listener.refusal_count, listener.refusals()


_form_and_step_under_the_flood.wants_conn = True


def test_a_ring_forms_and_steps_under_a_flood_of_junk_connections_with_bounded_stderr(capfd):
    capfd.readouterr()
    started = time.monotonic()
    with World(RANKS, _form_and_step_under_the_flood) as w:
        w.wait_formed()
        for r in range(RANKS):
            w.expect(r, "ready")
        flood = Flood(w.addresses).start()
        try:
            # Half the junk is silent: once 2 x 128 a port are out, the pending tables are full.
            wait_until(lambda: flood.opened >= 2 * 128 * RANKS, 15, "the flood to fill the listeners' pending tables")
            for r in range(RANKS):
                w.send(r, w.addresses)
            flood.thread.join(FLOOD_S + 10)  # the allreduces go on for as long as the flood does
            for r in range(RANKS):
                w.send(r, "stop")
            results = [w.expect(r, "ok", timeout=90)[1] for r in range(RANKS)]
        finally:
            flood.finish()
    elapsed = time.monotonic() - started
    err = capfd.readouterr().err

    for formed_in, steps, wrong, refused, refusals in results:
        assert wrong == [] and steps > 10, (steps, wrong)
        assert formed_in < 20, formed_in
        assert refused > RATE, refused  # the flood reached every listener
        assert all("\x1b" not in line and "\n" not in line for line in refusals)
    assert flood.opened > 2 * RATE * RANKS, flood.opened  # at least two seconds of it
    assert any("claiming job '\\x1b[2J\\x1b[31mpwned\\x07\\x0aelastic-ring: forged line'" in line
               for *_, refusals in results for line in refusals)
    assert "\x1b" not in err and "\x07" not in err, "a peer's escape codes reached stderr"
    lines = err.splitlines()
    bound = RANKS * LINES_PER_LISTENER_SECOND * (int(elapsed) + 2)
    assert len(lines) <= bound, f"{len(lines)} stderr lines in {elapsed:.1f} s (bound {bound}):\n" + "\n".join(lines[:20])
    assert all(line.startswith("elastic-ring: ") for line in lines), lines[:20]
    assert any("suppressed" in line for line in lines), "the rate limit never engaged"
