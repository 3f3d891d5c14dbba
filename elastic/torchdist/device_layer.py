"""The device communicators of a session: one made for each world as it forms, aborted as it ends.

``DeviceWorlds`` is a ``StepHooks`` the torch layer attaches to the session of ``elastic.run``
(``elastic.torchdist.step_hooks``); it holds at most one ``WorldDevice`` (``elastic.torchdist.
device_world``), the current world's:

* ``world_changed`` (every rank of a new world, after its ring formed): the last world's
  communicator is aborted and dropped, whatever ended it (a failure, a hang, a join, a clean
  leave, a preemption, a straggler evicted); then the ranks meet: one allgather on the new ring
  carries each rank's backend kind (they must agree: ``ELASTIC_DEVICE_BACKEND``) and rank 0's
  store port and nonce (``elastic.torchdist.device_store``: rank 0 hosts the world's store, every
  value signed with the job's secret), and every rank makes the new world's communicator and
  connects it.
* ``ring_aborted`` (the session aborted its ring: a peer failed, the rendezvous announced an
  abort, the world was superseded): the communicator is aborted from a side thread at once, so
  CUDA work behind it fails too, and the failure is noted by the session, so that a commit taken
  after it (of values a cut-short collective left) is refused and ``elastic.run`` recovers.
* ``ring_closed`` (this worker left, or the ring kept after the run was closed): aborted, dropped.
* A collective of the communicator that timed out or failed fails the world from the device's
  side: the session notes it, the blamed peer is reported (a timeout), and the ring is aborted,
  so the world re-forms as after a ring collective's failure.

``current(comm, device_type, what)`` is how the elastic group and DDP find the communicator a
tensor goes to: the one of the ring's world, never another world's.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from elastic.ring.errors import ErrorKind, SettingsMismatchError, WorkerLostError
from elastic.runtime.hooks import StepHooks, WorldChange
from elastic.torchdist import device_backend, device_store
from elastic.torchdist.device_world import WorldDevice

log = logging.getLogger("elastic")

_KIND_CODES = {"off": 0, "nccl": 1, "gloo": 2}
_CAUSE_WAIT_S = 2.0   # a communicator that failed to connect: how long to wait for the abort that explains it

Factory = Callable[[str, Any, int, int, int, float], device_backend.DeviceBackend]


def make_backend(kind: str, store: Any, world_version: int, rank: int, size: int, timeout: float
                 ) -> device_backend.DeviceBackend:
    if kind == "nccl":
        return device_backend.make_nccl(store, world_version, rank, size, timeout)
    return device_backend.make_gloo(store, world_version, rank, size, timeout)


class DeviceWorlds(StepHooks):
    """The session's device communicators, one per world (see the module doc)."""

    def __init__(self, session: Any, *, kind: str, abort_timeout: float, collective_timeout: float,
                 form_timeout: float, factory: Factory = make_backend) -> None:
        self.session = session
        self.kind = kind
        self.abort_timeout = abort_timeout
        self.collective_timeout = collective_timeout
        self.form_timeout = form_timeout
        self._factory = factory
        self._lock = threading.Lock()
        self._current: Optional[WorldDevice] = None
        self.made = 0   # communicators made in this session (one per world that had one)
        self._releasing: List[threading.Thread] = []   # threads of ended worlds still running (see WorldDevice.close)

    @classmethod
    def for_session(cls, session: Any) -> "DeviceWorlds":
        config = session.config
        return cls(session, kind=config.device_backend, abort_timeout=config.device_abort_timeout,
                   collective_timeout=config.comm.timeout, form_timeout=config.comm.form_timeout)

    # ------------------------------------------------------------------ what the group asks
    def device_type_now(self) -> Optional[str]:
        """The device whose tensors the current world's communicator takes (None: none now)."""
        device = self._current
        return device.device_type if device is not None else None

    def current(self, comm: Any, device_type: str, what: str) -> Optional[WorldDevice]:
        """The communicator tensors of ``device_type`` go to on ring ``comm``'s world; None when
        this session makes none for that device (they stay on the ring). Raises the world's
        ``WorkerLostError`` when it was aborted, or when the world has none any more."""
        device = self._current
        if device is None or device.device_type != device_type:
            return None
        if device.world_version != comm.world_version:
            raise WorkerLostError(f"{what}: the {device.backend.name} communicator belongs to world version "
                                  f"{device.world_version}, the ring to {comm.world_version}",
                                  op=what, world_version=comm.world_version, rank=comm.rank, kind=ErrorKind.Aborted)
        device.check(what)
        return device

    # ------------------------------------------------------------------ the step protocol
    def world_changed(self, change: WorldChange) -> None:
        version = change.current.world_version
        self._end(f"world version {version} formed")
        started = time.monotonic()
        device = self._meet(change)
        if device is None:
            return
        try:
            device.connect()
        except WorkerLostError:
            raise
        except Exception as e:
            # A peer that died meanwhile, or a configuration no world fixes: the rendezvous'
            # abort (or the ring's failure) tells which, within moments.
            if device.wait_aborted(_CAUSE_WAIT_S) or self.session.comm is None or self.session.comm.failed:
                raise device.error or WorkerLostError(f"world version {version}: connecting the {device.backend.name} "
                                                      f"communicator failed: {e}", op="connect",
                                                      world_version=version, kind=ErrorKind.Aborted) from e
            self._end(f"connecting it failed: {e}")
            raise RuntimeError(f"world version {version}: the {device.backend.name} communicator cannot connect "
                               f"(every peer is alive): {e}") from e
        log.info("device backend %s of world version %d made (rank %d of %d, store prefix %s) in %.3f s",
                 device.backend.name, version, change.current.rank, change.current.size,
                 getattr(device.backend, "prefix", "-"), time.monotonic() - started)

    def ring_aborted(self, reason: str) -> None:
        device = self._current
        if device is None:
            return
        device.abort(f"ring aborted: {reason}")
        if device.error is not None:
            self.session.note_failure(device.error)

    def ring_closed(self) -> None:
        self._end("the ring was closed")
        # The backends of earlier worlds may still be releasing (an aborted gloo backend waits
        # for its collectives to time out): the process must not exit under them.
        releasing, self._releasing = self._releasing, []
        deadline = time.monotonic() + self.collective_timeout + self.abort_timeout
        for thread in releasing:
            thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ worlds
    def _end(self, reason: str) -> None:
        with self._lock:
            device, self._current = self._current, None
        if device is not None:
            running = device.close(reason)
            self._releasing = [t for t in self._releasing if t.is_alive()] + running

    def _meet(self, change: WorldChange) -> Optional[WorldDevice]:
        """Agrees with the new world's ranks on the backend and rank 0's store; makes this rank's
        communicator (not yet connected) and makes it current. None when the world has none."""
        world, comm = change.current, self.session.ring("device communicator")
        kind = device_backend.resolve_kind(self.kind, torch.cuda.is_available)
        hosted = None
        nonce = device_store.new_nonce()
        host = device_store.split_host(world.peer(0).ring_address)   # every view names rank 0, the store's host
        timeout = _timedelta(self.form_timeout)
        try:
            if world.rank == 0 and kind != "off":
                hosted = device_store.HostedStore(host, timeout)
            row = np.array([_KIND_CODES[kind], hosted.port if hosted is not None else 0,
                            int.from_bytes(nonce[:8], "little", signed=True),
                            int.from_bytes(nonce[8:], "little", signed=True)], dtype=np.int64)
            rows = comm.allgather_equal(row)
            codes = rows[:, 0].tolist()
            if any(c != codes[0] for c in codes):
                names = {v: k for k, v in _KIND_CODES.items()}
                raise SettingsMismatchError(
                    f"world version {world.world_version}: the ranks make different device communicators (by rank: "
                    f"{[names.get(c, c) for c in codes]}); set ELASTIC_DEVICE_BACKEND alike on every worker (auto "
                    "is nccl where CUDA is available)", op="device communicator",
                    world_version=world.world_version, rank=world.rank, setting="ELASTIC_DEVICE_BACKEND")
            if kind == "off":
                return None
            port = int(rows[0, 1])
            nonce = int(rows[0, 2]).to_bytes(8, "little", signed=True) + int(rows[0, 3]).to_bytes(8, "little",
                                                                                                   signed=True)
            meeting = device_store.Meeting(host, port, nonce)
            inner = hosted.store if hosted is not None else device_store.connect(meeting, timeout)
            job_id = self.session.job_id
            store = device_store.SignedStore(inner, device_store.world_key(self.session.client.ring_secret, job_id,
                                                                           world.world_version, nonce),
                                             meeting.prefix(job_id, world.world_version))
            backend = self._factory(kind, store, world.world_version, world.rank, world.size, self.collective_timeout)
        except BaseException:
            if hosted is not None:
                hosted.close()
            raise
        device = WorldDevice(_Hosting(backend, hosted, meeting.prefix(job_id, world.world_version)),
                             collective_timeout=self.collective_timeout,
                             abort_timeout=self.abort_timeout, failed=self._device_failed)
        with self._lock:
            self._current = device
            self.made += 1
        if self.session.comm is not comm or comm.failed:   # aborted while meeting: ring_aborted found none
            device.abort("the ring was aborted while the communicator was made")
        return device

    def _device_failed(self, device: WorldDevice, error: WorkerLostError, blame: bool) -> None:
        """A collective of ``device`` timed out or failed: the session notes it, reports the
        blamed peer (a timeout) and aborts its ring, so every rank re-forms."""
        session = self.session
        session.note_failure(error)
        report = getattr(session, "report_failure", None)
        if blame and report is not None:
            # The verdict may take the heartbeat timeout (a probe): not on the watcher thread.
            threading.Thread(target=report, args=(error,), name="elastic-device-report", daemon=True).start()
        comm = session.comm
        if comm is not None and comm.world_version == device.world_version:
            session.abort_ring(str(error), comm)


class _Hosting(device_backend.DeviceBackend):
    """A backend and, on rank 0, the store it met over: the store goes when the backend does."""

    def __init__(self, backend: device_backend.DeviceBackend, hosted: Optional[device_store.HostedStore],
                 prefix: str) -> None:
        super().__init__(backend.world_version, backend.rank, backend.size)
        self.inner, self._hosted, self.prefix = backend, hosted, prefix
        self.name, self.device_type, self.native_average = backend.name, backend.device_type, backend.native_average

    def connect(self) -> None:
        self.inner.connect()

    def run(self, method: str, *args: Any) -> Any:
        return self.inner.run(method, *args)

    def finish(self, work: Any) -> None:
        self.inner.finish(work)

    def completion(self) -> Any:
        return self.inner.completion()

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> Optional[threading.Thread]:
        release = self.inner.close()
        if self._hosted is not None:
            self._hosted.close()
        return release


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def layer_of(session: Any) -> Optional[DeviceWorlds]:
    """The session's ``DeviceWorlds``, if the torch layer attached one."""
    if session is None:
        return None
    for h in session.hooks:
        if isinstance(h, DeviceWorlds):
            return h
    return None


__all__ = ["DeviceWorlds", "layer_of", "make_backend"]
