"""Prometheus metrics of one rendezvous replica (`serve --metrics-port P`), in a registry of its own.

Each server has its own `CollectorRegistry` (never the process-wide default), so several servers in
one process (tests, an embedded server next to a real one) do not collide. What it costs per event:

* The job gauges (jobs by state, per job world version, members, standby, pending joins) are read
  from the jobs' states when Prometheus scrapes, on the HTTP server's thread: nothing per event,
  and a job's series vanish with it. Only jobs that are not finished get per-job series, so their
  number is bounded by the server's job cap (`max_jobs`); finished jobs count in `jobs{state}`.
* Counters (evictions, worlds, elections, RPCs) cost one increment; latencies one histogram
  observation, per RPC and per store call, never per stream message.

Names follow Prometheus conventions: `elastic_rendezvous_…`, base units, `_total` counters,
`_seconds` histograms. docs/reference/metrics.md lists them all.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable, Optional

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rendezvous.server import decision as d
from rendezvous.server.description import Description
from rendezvous.common.metrics_http import MetricsServer
from rendezvous.server.store import Claim, Store, StoreError

P = "elastic_rendezvous_"

# Failure signal -> next world: from a few settle windows (0.2 s) up to the reattach window and
# an elastic timeout (minutes).
RECOVERY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0)
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STORE_OPERATIONS = ("get", "get_prefix", "put", "delete", "commit", "claim", "refresh_claim", "release_claim")


def job_counts(state: d.JobState) -> tuple[int, int, int]:
    """(members, standby, pending joins) of a job: members of its world still registered; workers
    outside the world for whom it has room (they enter at the next re-form: pending joins); the
    rest outside it (hot spares beyond max_np: standby)."""
    members = sum(1 for m in state.world if m.worker_id in state.workers)
    outside = len(state.workers) - members
    pending = min(outside, max(0, state.spec.max_np - members))
    return members, outside - pending, pending


class _JobsCollector:
    """The gauges read at scrape time (on the HTTP server's thread), through the functions given."""

    def __init__(self, job_states: Callable[[], Iterable[d.JobState]], is_leader: Callable[[], bool],
                 elections: Callable[[], int], leadership_losses: Callable[[], int]):
        self._job_states = job_states
        self._is_leader = is_leader
        self._elections = elections
        self._leadership_losses = leadership_losses

    def collect(self):
        # Each job's state is an immutable value, so what is read from it is consistent.
        states = list(self._job_states())
        yield GaugeMetricFamily(P + "leader", "1 while this replica is the leader, else 0",
                                value=1 if self._is_leader() else 0)
        by_state = GaugeMetricFamily(P + "jobs", "Jobs this replica serves, by state (the "
                                                 "leader's view; followers serve none)",
                                     labels=["state"])
        counts = {p.value: 0 for p in d.Phase}
        gauges = {
            "world_version": GaugeMetricFamily(P + "job_world_version",
                                               "Version of the job's current world (0: none yet)",
                                               labels=["job_id"]),
            "members": GaugeMetricFamily(P + "job_members", "Members of the job's world still "
                                                            "registered", labels=["job_id"]),
            "standby": GaugeMetricFamily(P + "job_standby_workers", "Registered workers outside "
                                         "the world beyond max_np (hot spares)", labels=["job_id"]),
            "pending": GaugeMetricFamily(P + "job_pending_joins", "Registered workers outside the "
                                         "world that the next world takes", labels=["job_id"]),
            "min_np": GaugeMetricFamily(P + "job_min_workers", "The job's min_np",
                                        labels=["job_id"]),
            "blacklisted": GaugeMetricFamily(P + "job_blacklisted_hosts", "Hosts of the job in a "
                                             "blacklist cooldown", labels=["job_id"]),
        }
        now = time.time()
        for state in states:
            counts[state.phase.value] = counts.get(state.phase.value, 0) + 1
            if state.phase in d.TERMINAL:
                continue
            members, standby, pending = job_counts(state)
            labels = [state.job_id]
            gauges["world_version"].add_metric(labels, state.world_version)
            gauges["members"].add_metric(labels, members)
            gauges["standby"].add_metric(labels, standby)
            gauges["pending"].add_metric(labels, pending)
            gauges["min_np"].add_metric(labels, state.spec.min_np)
            gauges["blacklisted"].add_metric(labels, len(state.blacklisted_hosts(now)))
        for phase, n in counts.items():
            by_state.add_metric([phase], n)
        yield by_state
        yield from gauges.values()
        elections = CounterMetricFamily(P + "leader_elections", "Times this replica became "
                                                                "the leader")
        elections.add_metric([], self._elections())
        yield elections
        losses = CounterMetricFamily(P + "leadership_losses", "Times this replica stopped "
                                                              "leading other than by shutting down")
        losses.add_metric([], self._leadership_losses())
        yield losses


class ServerMetrics:
    """The metrics of one RendezvousService; `serve(host, port)` exposes them on /metrics.

    Given plain functions, not the service: `job_states()` (the states of the jobs it serves; called
    on the HTTP server's thread, so it must only copy), `is_leader()` and `leadership_losses()`."""

    def __init__(self, *, job_states: Callable[[], Iterable[d.JobState]],
                 is_leader: Callable[[], bool], leadership_losses: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        r.register(_JobsCollector(job_states, is_leader, lambda: self.elections, leadership_losses))
        self.elections = 0
        self.evictions = Counter(P + "evictions", "Workers evicted, by cause", ["cause"],
                                 registry=r)
        for cause in d.Departure:
            if cause.eviction is not None:
                self.evictions.labels(cause.eviction)   # every cause present from the start, at 0
        self.worlds = Counter(P + "worlds_announced", "Worlds announced (stored, then sent)",
                              registry=r)
        self.recovery = Histogram(P + "failure_to_world_seconds",
                                  "From a failure signal of a job (a stream broke, a report, a "
                                  "missed deadline) to the next world it announced",
                                  buckets=RECOVERY_BUCKETS, registry=r)
        self.rpcs = Counter(P + "rpcs", "RPCs handled, by method and gRPC status code "
                                        "(Watch counted when its stream ends)",
                            ["method", "code"], registry=r)
        self.rpc_seconds = Histogram(P + "rpc_seconds", "Time to answer a unary RPC, by method",
                                     ["method"], buckets=RPC_BUCKETS, registry=r)
        self.store_seconds = Histogram(P + "store_operation_seconds",
                                       "Time of a store (etcd) operation, by operation",
                                       ["operation"], buckets=STORE_BUCKETS, registry=r)
        self.store_errors = Counter(P + "store_errors", "Store (etcd) operations that failed, "
                                                        "by operation", ["operation"], registry=r)
        for op in STORE_OPERATIONS:
            self.store_seconds.labels(op)
            self.store_errors.labels(op)
        self._http = None

    # ------------------------------------------------------------------------------ hooks
    def elected(self) -> None:
        self.elections += 1

    def delivered(self, what: Description, recovery_s: Optional[float] = None) -> None:
        """A durable action took effect; `recovery_s`: the seconds from the failure signal it
        recovers from to this new world (liveness.Liveness.world_announced), if any."""
        if what.world_announced:
            self.worlds.inc()
        if recovery_s is not None:
            self.recovery.observe(recovery_s)
        if what.eviction is not None:
            self.evictions.labels(what.eviction).inc()

    def interceptor(self) -> "RpcMetrics":
        return RpcMetrics(self)

    def metered(self, store: Store) -> "MeteredStore":
        return MeteredStore(store, self)

    # ------------------------------------------------------------------------------ /metrics
    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port) from a daemon thread; returns the port."""
        self._http = MetricsServer(self.registry, host, port, name="rendezvous-metrics-http")
        return self._http.port

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def _code_name(context) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


class RpcMetrics(aio.ServerInterceptor):
    """Counts every RPC of a registered method by method and final status code, and times the
    unary ones. Outermost interceptor: it sees the code the auth guard's aborts set."""

    def __init__(self, metrics: ServerMetrics):
        self._m = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:   # unknown methods are not counted: their names are the caller's
            return None
        method = details.method.rsplit("/", 1)[-1]
        rpcs, seconds = self._m.rpcs, self._m.rpc_seconds
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                start = time.perf_counter()
                code = "UNKNOWN"
                try:
                    response = await inner(request, context)
                    code = _code_name(context)
                    return response
                except aio.AbortError:
                    code = _code_name(context)
                    raise
                except asyncio.CancelledError:
                    code = "CANCELLED"
                    raise
                finally:
                    rpcs.labels(method, code).inc()
                    seconds.labels(method).observe(time.perf_counter() - start)
            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                code = "UNKNOWN"
                try:
                    await inner_stream(request, context)
                    code = _code_name(context)
                except aio.AbortError:
                    code = _code_name(context)
                    raise
                except asyncio.CancelledError:   # the client went away (or keepalive cut it)
                    code = "CANCELLED"
                    raise
                finally:
                    rpcs.labels(method, code).inc()
            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


class MeteredStore(Store):
    """A Store that times every operation of the one it wraps and counts its StoreErrors. It looks
    the wrapped store's methods up at each call, so whatever replaces one there is used."""

    def __init__(self, inner: Store, metrics: ServerMetrics):
        self.inner = inner
        self._ops = {op: (metrics.store_seconds.labels(op), metrics.store_errors.labels(op))
                     for op in STORE_OPERATIONS}

    async def _timed(self, op: str, call):
        seconds, errors = self._ops[op]
        start = time.perf_counter()
        try:
            return await call
        except StoreError:
            errors.inc()
            raise
        finally:
            seconds.observe(time.perf_counter() - start)

    async def get(self, key):
        return await self._timed("get", self.inner.get(key))

    async def get_prefix(self, prefix):
        return await self._timed("get_prefix", self.inner.get_prefix(prefix))

    async def put(self, key, value, *, expected_revision=None, fence=None):
        return await self._timed("put", self.inner.put(key, value, expected_revision=expected_revision,
                                                       fence=fence))

    async def delete(self, key, *, expected_revision=None, fence=None):
        return await self._timed("delete", self.inner.delete(key, expected_revision=expected_revision,
                                                             fence=fence))

    async def commit(self, puts, deletes=(), *, expected={}, fence=None, delete_prefixes=()):  # noqa: B006
        return await self._timed("commit", self.inner.commit(puts, deletes, expected=expected, fence=fence,
                                                             delete_prefixes=delete_prefixes))

    async def claim(self, key, value, ttl_s):
        claim = await self._timed("claim", self.inner.claim(key, value, ttl_s))
        return None if claim is None else _MeteredClaim(claim, self)

    async def close(self):
        await self.inner.close()


class _MeteredClaim(Claim):
    """A claim of a MeteredStore: its refreshes and its release are timed and counted too."""

    def __init__(self, inner: Claim, store: MeteredStore):
        self.inner, self._store = inner, store

    async def refresh(self):
        return await self._store._timed("refresh_claim", self.inner.refresh())

    def blocking_refresh(self):
        inner = self.inner.blocking_refresh()
        if inner is None:
            return None
        seconds, errors = self._store._ops["refresh_claim"]

        def timed() -> bool:
            start = time.perf_counter()
            try:
                return inner()
            except StoreError:
                errors.inc()
                raise
            finally:
                seconds.observe(time.perf_counter() - start)
        return timed

    async def release(self):
        return await self._store._timed("release_claim", self.inner.release())
