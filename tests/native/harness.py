"""Runs a function on N real worker processes that form a ring over loopback.

Workers are forked (no re-import of torch per worker), each opens its own listener,
the parent hands every worker the full address list, and results come back over
pipes. Every wait has a deadline; leftover processes are killed on exit.

``transport`` picks how the ring runs: "tcp" (no host names: every link over TCP), "shm"
(every rank announces the same host name: every link through shared memory), or an
explicit list of host names per rank (a mixed world when some differ).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

import elastic

_CTX = mp.get_context("fork")
# What the fork server imports once, so that its workers start without importing torch. torch._dynamo
# is what a worker's first optimizer imports (torch.optim loads it lazily): 1.6 s of CPU each.
_FORKSERVER_PRELOAD = ["numpy", "torch", "torch._dynamo", "elastic", "tests.native.harness"]


def _context(start_method: str):
    if start_method == "fork":
        return _CTX
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # Ignored once the server runs: every caller asks for the same list.
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


class WorkerFailed(AssertionError):
    pass


TRANSPORTS = ["tcp", "shm"]


def mixed_hosts(*ranks_per_host: int) -> List[str]:
    """Host names for a mixed world simulated on this machine: ``mixed_hosts(2, 2)`` is
    host-a, host-a, host-b, host-b. Same-host ring neighbours use shared memory, the others
    TCP over loopback; each host's ranks are contiguous in rank order, as the runtime makes them."""
    return [f"host-{chr(ord('a') + h)}" for h, k in enumerate(ranks_per_host) for _ in range(k)]


# The hierarchical allreduce on every buffer size wherever it applies (a mixed world).
HIERARCHICAL = elastic.CommConfig(timeout=60, algorithm="hierarchical")


def hosts_for(transport: Union[str, Sequence[str]], n: int) -> Optional[List[str]]:
    if transport == "tcp":
        return None
    if transport == "shm":
        return ["this-host"] * n
    hosts = list(transport)
    assert len(hosts) == n, f"{len(hosts)} host names for {n} ranks"
    return hosts


def _worker_main(rank: int, n: int, conn, fn: Callable, config: Optional[elastic.CommConfig], job_id: str,
                 secret: bytes, world_version: int, hosts: Optional[List[str]],
                 view_of: Optional[Callable] = None) -> None:
    try:
        # A forked child cannot use the OpenMP thread pool of a parent that already ran a
        # parallel torch op (collecting the whole suite does): its first one would hang.
        torch.set_num_threads(1)
        listener = elastic.Listener("127.0.0.1", 0)
        conn.send(("address", listener.address))
        if not conn.poll(60):
            return
        peers = conn.recv()
        if view_of is not None:   # only what this rank's view names, as a worker of a job gets it
            comm = elastic.Communicator.form(listener=listener, job_id=job_id, secret=secret,
                                             world_version=world_version, rank=rank, config=config,
                                             view=view_of(rank, peers, hosts))
        else:
            comm = elastic.Communicator.form(listener=listener, job_id=job_id, secret=secret,
                                             world_version=world_version, rank=rank, peers=peers, config=config,
                                             hosts=hosts)
        comm.listener = listener  # for tests that inspect refusals
        comm.hosts = hosts  # for tests that re-form
        conn.send(("formed", time.monotonic()))
        try:
            result = fn(comm, conn) if getattr(fn, "wants_conn", False) else fn(comm)
            conn.send(("ok", result))
        finally:
            comm.close()
    except BaseException as e:  # reported to the parent, which fails the test
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc(), _attrs(e), time.monotonic()))
    finally:
        conn.close()


def _attrs(e: BaseException) -> dict:
    return {k: getattr(e, k) for k in ("op", "world_version", "rank", "peer", "reason") if hasattr(e, k)}


class World:
    """N worker processes forming one ring. Use as a context manager."""

    def __init__(self, n: int, fn: Callable, *, config: Optional[elastic.CommConfig] = None,
                 job_id: str = "test-job", secret: bytes = b"test-secret", world_version: int = 1,
                 transport: Union[str, Sequence[str]] = "tcp", start_method: str = "fork",
                 view_of: Optional[Callable] = None):
        # "forkserver" for tests that run late in a session: by then the test process may hold
        # gRPC and etcd client threads and has run torch's thread pools, and forking such a
        # process is not safe. Workers are forked from a server that only imported the modules
        # of _FORKSERVER_PRELOAD (once per session), so they start in a fraction of a second.
        # It needs `fn` to be importable (a module-level function), and workers see the
        # environment of when the server started: a test that sets a variable for its workers
        # takes "spawn" (an import of torch each). `view_of(rank, addresses, hosts)`, if given, is
        # the RingView each rank forms from instead of the full list.
        ctx = _context(start_method)
        self.n = n
        self.hosts = hosts_for(transport, n)
        self.pipes = [ctx.Pipe() for _ in range(n)]
        self.procs = [ctx.Process(target=_worker_main,
                                   args=(r, n, self.pipes[r][1], fn, config, job_id, secret, world_version,
                                         self.hosts, view_of),
                                   daemon=True) for r in range(n)]
        self.addresses: List[str] = []

    def __enter__(self) -> "World":
        for p in self.procs:
            p.start()
        for r in range(self.n):
            msg = self._recv(r, 30)
            assert msg[0] == "address", f"rank {r} failed before listening: {msg}"
            self.addresses.append(msg[1])
        for r in range(self.n):
            self.pipes[r][0].send(self.addresses)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
        for p in self.procs:
            p.join(10)

    def _recv(self, rank: int, timeout: float):
        conn = self.pipes[rank][0]
        if not conn.poll(timeout):
            raise WorkerFailed(f"rank {rank} sent nothing within {timeout} s")
        return conn.recv()

    def wait_formed(self, timeout: float = 30) -> None:
        """Waits until every rank formed; fails naming every rank that did not (the rank that
        failed first, whose reason explains the others', is often not rank 0)."""
        self._every_rank("formed", "failed to form:", timeout)

    def message(self, rank: int, timeout: float = 60):
        """Next message from a worker: ("ok", result) or ("error", type, text, tb, attrs, t)."""
        return self._recv(rank, timeout)

    def expect(self, rank: int, kind: str, timeout: float = 60):
        """Waits for a message of the given kind from a worker and returns it."""
        msg = self._recv(rank, timeout)
        if msg[0] != kind:
            detail = f"{msg[1]}: {msg[2]}\n{msg[3]}" if msg[0] == "error" else repr(msg)
            raise WorkerFailed(f"rank {rank}: expected {kind!r}, got {detail}")
        return msg

    def send(self, rank: int, obj: Any) -> None:
        self.pipes[rank][0].send(obj)

    def results(self, timeout: float = 120) -> List[Any]:
        """Waits for every worker and returns their results; fails on any worker error."""
        self.wait_formed(timeout)
        return [m[1] for m in self._every_rank("ok", "raised", timeout)]

    def _every_rank(self, kind: str, failing: str, timeout: float) -> List[Any]:
        """Each rank's next message, all of ``kind``; else fails naming every rank that sent
        another, not only the first: the rank that failed first is often not rank 0."""
        deadline = time.monotonic() + timeout
        msgs = [self._recv(r, max(1.0, deadline - time.monotonic())) for r in range(self.n)]
        failed = [(r, m) for r, m in enumerate(msgs) if m[0] != kind]
        if failed:
            raise WorkerFailed("\n".join(f"rank {r} {failing} {m[1]}: {m[2]}" for r, m in failed)
                               + f"\n{failed[0][1][3]}")
        return msgs

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> float:
        os.kill(self.procs[rank].pid, sig)
        return time.monotonic()


def run_world(n: int, fn: Callable, timeout: float = 120, **kw) -> List[Any]:
    with World(n, fn, **kw) as w:
        return w.results(timeout)


def allreduce_forever(elements: int) -> Callable:
    """A worker body: one allreduce of `elements` float32, then "running", then the same
    allreduce forever, so every later moment is inside a collective."""
    def body(comm, conn):
        buf = np.ones(elements, dtype=np.float32)
        comm.allreduce_(buf, elastic.Sum)
        conn.send(("running", time.monotonic()))
        while True:
            comm.allreduce_(buf, elastic.Sum)

    body.wants_conn = True
    return body


def kill_mid_allreduce(n: int, victim: int, *, elements: int = 64 << 20, budget_s: float = 0.5,
                       body: Optional[Callable] = None, **world_kw) -> Dict[int, tuple]:
    """SIGKILLs rank `victim` while every rank is inside an allreduce (256 MiB by default; or
    inside whatever `body` runs forever after it says "running") and checks that every
    survivor raised WorkerLostError (peer_lost or propagated) within `budget_s` of the kill;
    returns the survivors' error messages by rank."""
    errors = {}
    with World(n, body or allreduce_forever(elements), **world_kw) as w:
        w.wait_formed()
        for r in range(n):
            w.expect(r, "running", timeout=120)
        killed_at = w.kill(victim, signal.SIGKILL)
        for r in range(n):
            if r == victim:
                continue
            msg = w.expect(r, "error", timeout=10)
            assert msg[1] == "WorkerLostError", msg[2]
            assert msg[5] - killed_at < budget_s, f"rank {r} took {msg[5] - killed_at:.3f} s"
            assert msg[4]["reason"] in ("peer_lost", "propagated"), msg[4]
            errors[r] = msg
    return errors


def blamed(errors: Dict[int, tuple]) -> List[int]:
    """The ranks the survivors named as lost (a "propagated" failure names nobody)."""
    return [msg[4]["peer"] for msg in errors.values() if msg[4]["reason"] == "peer_lost"]
