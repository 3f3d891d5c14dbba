"""A job of 4,096 workers (simulated: grpc.aio clients in this process, 64 Watch streams a
connection) on the etcd-backed server: it forms, loses 40 workers at once, and re-forms, within a
minute; no World message grows with the job (bench/rendezvous_scale.py measures the same, larger)."""
from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
from grpc import aio

from rendezvous.common.channel import channel_options
from rendezvous.wire.messages import pb, pb_grpc

from .rdzv_helpers import ServerProc, run_async

N, KILLED, PER_CHANNEL = 4096, 40, 64


class Sim:
    """One simulated worker: Join, then a Watch read as raw bytes (its size as sent)."""

    def __init__(self, channel, job: str, i: int):
        self.channel, self.job, self.i = channel, job, i
        self.stub = pb_grpc.RendezvousStub(channel)
        self.watch = channel.unary_stream("/elastic.rendezvous.v1.Rendezvous/Watch",
                                          request_serializer=pb.WatchRequest.SerializeToString,
                                          response_deserializer=None)
        self.worlds: dict[int, int] = {}     # size -> bytes of the World message
        self.asked_to_ack: list[bool] = []   # each abort's `acknowledge`
        self.changed = asyncio.Event()
        self.task = None

    async def join(self) -> None:
        resp = await self.stub.Join(pb.JoinRequest(
            job_id=self.job, worker_id=f"w{self.i:05d}", host=f"host{self.i // 8}",
            ring_address=f"10.{self.i // 8 // 250}.{self.i // 8 % 250}.1:{4000 + self.i % 8}", commit_step=-1,
            spec=pb.JobSpec(min_np=1, max_np=N)), timeout=60)
        self.task = asyncio.get_running_loop().create_task(self._read(resp.session_id))

    async def _read(self, session: str) -> None:
        try:
            async for data in self.watch(pb.WatchRequest(session_id=session)):
                ev = pb.WatchEvent.FromString(data)
                if ev.WhichOneof("event") == "world":
                    if ev.world.HasField("aborted"):   # the abort, riding with the next world
                        self.asked_to_ack.append(ev.world.aborted.acknowledge)
                    self.worlds[ev.world.size] = len(data)
                    self.changed.set()
                elif ev.WhichOneof("event") == "abort":
                    self.asked_to_ack.append(ev.abort.acknowledge)
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    async def holds(self, size: int, deadline: float) -> int:
        while size not in self.worlds:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.01, deadline - time.monotonic()))
        return self.worlds[size]


@pytest.mark.slow
def test_a_job_of_4096_workers_forms_loses_40_and_re_forms_within_a_minute(etcd, tmp_path):
    # As in the benchmark: one process simulates every worker, so Watches open later than real
    # workers' would; a heartbeat timeout of 10 s keeps that from evicting them.
    server = ServerProc(tmp_path, "--etcd", etcd.endpoint, "--etcd-prefix", f"/t/{uuid.uuid4().hex[:12]}",
                        "--insecure", "--heartbeat-timeout", "10", "--leader-ttl", "10", "--log-level", "WARNING")

    async def body():
        started = time.monotonic()
        channels = [aio.insecure_channel(server.address, options=channel_options()) for _ in range(KILLED)]
        channels += [aio.insecure_channel(server.address, options=channel_options())
                     for _ in range(-(-(N - KILLED) // PER_CHANNEL))]
        sims = [Sim(channels[i], job, i) for i in range(KILLED)]
        sims += [Sim(channels[KILLED + (i - KILLED) // PER_CHANNEL], job, i) for i in range(KILLED, N)]
        gate = asyncio.Semaphore(256)

        async def join(s):
            async with gate:
                await s.join()
        try:
            await asyncio.gather(*(join(s) for s in sims))
            deadline = started + 45
            formed = await asyncio.gather(*(s.holds(N, deadline) for s in sims))
            for c in channels[:KILLED]:        # 40 workers crash at once: their connections drop
                await c.close(grace=None)
            survivors = sims[KILLED:]
            re_formed = await asyncio.gather(*(s.holds(N - KILLED, started + 58) for s in survivors))
            took = time.monotonic() - started
            assert took < 60, took
            # Every worker's World is its view: a few hundred bytes in a job of 4,096.
            assert max(formed + re_formed) <= 1024, max(formed + re_formed)
            # The abort reached every survivor (on its own or with the next world; twice, should the
            # 40 failures have been split over two settle windows), and a world this large is not
            # asked to answer it: 4,056 acknowledgements would cost the leader more than the window.
            assert all(s.asked_to_ack and not any(s.asked_to_ack) for s in survivors)
        finally:
            for s in sims:
                if s.task is not None:
                    s.task.cancel()
            for c in channels[KILLED:]:
                await c.close(grace=None)

    job = f"scale-{uuid.uuid4().hex[:8]}"
    try:
        run_async(body(), 90.0)
    finally:
        server.kill()
