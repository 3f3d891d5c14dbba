"""Helpers shared by the rendezvous tests: deadlines, in-process servers, clients, real processes.

Tests here import them relatively (`from .rdzv_helpers import ...`); other folders as
`tests.rendezvous.rdzv_helpers`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from tests.waiting import wait_until  # noqa: F401  (re-exported for the tests here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "rendezvous", "worker_proc.py")


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


class ServerProc:
    """`python -m rendezvous serve …` as a child process; waits until it listens."""

    def __init__(self, tmp_path, *args, port=0, timeout_s=20.0, prefix=()):
        self.port_file = str(tmp_path / f"port-{time.monotonic_ns()}")
        self.log_path = self.port_file + ".log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "rendezvous", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--port-file", self.port_file, *args],
            cwd=REPO, env=child_env(), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"rendezvous server did not start: {self.log()}")
            time.sleep(0.02)
        self.port = int(open(self.port_file).read())
        self.address = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


class WorkerProc:
    """tests/rendezvous/worker_proc.py as a child; its JSON event lines are collected as they come."""

    def __init__(self, addresses, job, worker_id, host="h", min_np=1, max_np=8, hold_gil_s=0.0):
        args = [sys.executable, WORKER, ",".join(addresses), job, worker_id, host, str(min_np),
                str(max_np)]
        if hold_gil_s:
            args += ["--hold-gil-after-world", str(hold_gil_s)]
        self.worker_id = worker_id
        self.proc = subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.events: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()

    def wait_event(self, pred, timeout_s: float, what: str) -> dict:
        """The first collected event matching `pred` (already seen or future), within the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    err = self.proc.stderr.read().decode()[-2000:] if self.proc.poll() is not None else ""
                    raise AssertionError(f"worker {self.worker_id}: no {what} within {timeout_s} s; "
                                         f"events {self.events}; stderr {err}")
                self._cond.wait(min(left, 0.1))

    def world(self, version: int, timeout_s: float = 10.0) -> dict:
        return self.wait_event(lambda e: e["event"] == "world" and e["version"] == version, timeout_s,
                               f"world {version}")

    def world_of_size(self, size: int, timeout_s: float = 10.0) -> dict:
        return self.wait_event(lambda e: e["event"] == "world" and e["size"] == size, timeout_s,
                               f"a world of {size}")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)  # SIGKILL ends a SIGSTOPped process too
            if sig == signal.SIGKILL:
                self.proc.wait(10)


def run_async(coro, timeout_s: float = 60.0):
    """Run a coroutine to completion with a deadline (no test may hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))




_ids = itertools.count()


def unique(name: str) -> str:
    return f"{name}-{next(_ids)}-{uuid.uuid4().hex[:6]}"


class ServerThread:
    """A RendezvousServer on its own event loop in a background thread (real gRPC on loopback)."""

    def __init__(self, config, store_factory):
        import threading

        from rendezvous.server.service import RendezvousServer

        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def start():
            self.server = RendezvousServer(config, store_factory())
            port = await self.server.start()
            await self.server.wait_leader(15.0)
            return port

        self.port = self.call(start())
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    @property
    def service(self):
        return self.server.service

    def stop(self):
        self.call(self.server.stop(grace_s=0.5))

        async def cancel_rest():  # background tasks (timers, keepalives) end with the loop
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.call(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)


def server_config(**kw):
    from rendezvous.server.server_config import ServerConfig

    base = dict(host="127.0.0.1", port=0, insecure=True, heartbeat_timeout_s=2.0, settle_s=0.1,
                etcd_prefix=f"/t/{uuid.uuid4().hex[:12]}")
    base.update(kw)
    return ServerConfig(**base)


def make_client(address, worker_id, job_id="job", host="h", port=None, **kw):
    from rendezvous.wire.membership import JobSpec
    from rendezvous.client.worker_client import RendezvousClient

    addresses = address if isinstance(address, list) else [address]
    kw.setdefault("spec", JobSpec(min_np=1, max_np=8))
    return RendezvousClient(addresses, job_id=job_id, worker_id=worker_id, host=host,
                            ring_address=f"127.0.0.1:{port or 20000 + next(_ids) % 40000}", **kw)


def wait_world_of(clients, size, timeout_s=10.0, min_version=1):
    """Each client's next world of `size` members; asserts they all agree. Returns the worlds."""
    worlds = []
    for c in clients:
        deadline = time.monotonic() + timeout_s
        while True:
            w = c.wait_world(timeout_s=max(0.01, deadline - time.monotonic()),
                             min_version=min_version)
            if w.size == size:
                worlds.append(w)
                break
    assert len({w.world_version for w in worlds}) == 1, [w.world_version for w in worlds]
    assert sorted(w.rank for w in worlds) == list(range(size))
    return worlds


def join_world(clients, timeout_s=10.0):
    """Join every client, then wait up to `timeout_s` for the world that holds them all; returns
    its version.

    The joins go one after another, so on a slow store (etcd on a loaded machine) two of them can
    land more than settle_s apart and a world of fewer forms first: count later worlds from the
    version this returns, never from 1."""
    for c in clients:
        c.join()
    return wait_world_of(clients, len(clients), timeout_s)[0].world_version


def next_of(client, kinds, timeout_s=5.0):
    """The next event of type `kinds` (a type or a tuple of types; others skipped), failing after
    the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        ev = client.next_event(deadline - time.monotonic())
        if ev is None:
            names = "/".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))
            raise AssertionError(f"{client.worker_id}: no {names} within {timeout_s} s")
        if isinstance(ev, kinds):
            return ev


class StallProxy:
    """A TCP proxy on loopback whose traffic can be frozen (`stall()`): connections stay open but no
    byte moves, as when a replica's link to etcd hangs while its clients still reach it."""

    def __init__(self, target_port: int):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._writers = []

        async def start():
            self._flowing = asyncio.Event()
            self._flowing.set()
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            return self._server.sockets[0].getsockname()[1]

        self._target = target_port
        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.endpoint = f"127.0.0.1:{self.port}"

    async def _pipe(self, reader, writer):
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader, writer):
        try:
            tr, tw = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.close()
            return
        self._writers += [writer, tw]
        asyncio.ensure_future(self._pipe(reader, tw))
        asyncio.ensure_future(self._pipe(tr, writer))

    def stall(self):
        self.loop.call_soon_threadsafe(self._flowing.clear)

    def resume(self):
        self.loop.call_soon_threadsafe(self._flowing.set)

    def close(self):
        async def shut():
            self._server.close()
            for w in self._writers:
                w.close()
        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

