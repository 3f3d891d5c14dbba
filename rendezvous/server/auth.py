"""Who is calling: the token check in front of every RPC, the caller's credential, and session ids.

Rules:
* A job belongs to the token that created it (the state keeps its SHA-256, its credential): a caller
  with another accepted token is refused at Join (PERMISSION_DENIED), sees nothing of it in Status,
  and its session ids name an unknown job. With --insecure there is no token and every caller's
  credential is "", so nobody is told apart: anyone who can reach the server can join any job.
* A session id is a capability: JOB/RUN/WORKER/SECRET with 192 random bits; the state keeps the
  secret's SHA-256, compared in constant time. RUN is the random tag of one run of the job id, so a
  session of an earlier run does not carry over.
* Each job's ring secret is 32 random bytes made when the job (each run of its id) is created,
  stored with it and given only to accepted joiners.

`Guard` also parses every request and turns a handler's `RpcRefusal` (and any bug) into a status, so
no RPC can crash the server.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
import logging
import re
import secrets
from typing import Optional, Sequence

import grpc
from grpc import aio

from rendezvous.server import decision as d
from rendezvous.server.server_wire import RpcRefusal

log = logging.getLogger("rendezvous.server.service")

SESSION_SECRET_BYTES = 24     # 192 random bits
RING_SECRET_BYTES = 32
# JOB/RUN/WORKER/SECRET: the job and worker route the lookup; the secret decides. Used with fullmatch.
SESSION_RE = re.compile(r"([A-Za-z0-9._-]{1,128})/([0-9a-f]{8})/([A-Za-z0-9._-]{1,128})/([0-9a-f]{48})")
MAX_SESSION_CHARS = 400
DENIED = "missing or wrong token: send metadata 'authorization: Bearer <token>'"

# The credential of the RPC being served; set by Guard. "" without tokens.
_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("rendezvous_caller", default="")


def caller() -> str:
    """The credential of the token the current RPC presented ("" with --insecure)."""
    return _CALLER.get()


def credential_of(token: Optional[str]) -> str:
    """What a job stores of the token that created it (SHA-256, hex); "" for no token (--insecure)."""
    return hashlib.sha256(token.encode()).hexdigest() if token else ""


def owns(state: d.JobState, credential: str) -> bool:
    """Whether `credential` is the one that created the job (constant time)."""
    return hmac.compare_digest(state.credential, credential)


def new_session(job: d.JobState, worker_id: str) -> tuple[str, str]:
    """A fresh session id for `worker_id` and the hash the state keeps of it."""
    secret = secrets.token_hex(SESSION_SECRET_BYTES)
    return f"{job.job_id}/{job.run}/{worker_id}/{secret}", session_hash(secret)


def session_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_session(session_id: str) -> Optional[tuple[str, str, str, str]]:
    """(job_id, run, worker_id, secret) of a well-formed session id; None for anything else."""
    m = SESSION_RE.fullmatch(session_id) if len(session_id) <= MAX_SESSION_CHARS else None
    return None if m is None else (m.group(1), m.group(2), m.group(3), m.group(4))


def holds_session(worker: Optional[d.Worker], secret: str) -> bool:
    """Whether `secret` is `worker`'s current session secret: constant time, and the same work
    whether the worker exists or not."""
    matches = hmac.compare_digest(session_hash(secret), worker.session_hash if worker else "0" * 64)
    return worker is not None and matches


def new_ring_secret() -> str:
    return secrets.token_bytes(RING_SECRET_BYTES).hex()


def new_run() -> str:
    return secrets.token_hex(4)


class Guard(grpc.aio.ServerInterceptor):
    """Checks the token and turns RpcRefusal/unexpected errors into statuses, so no RPC crashes the
    server. The credential of the token presented is what the handlers see in `caller()`."""

    def __init__(self, tokens: Sequence[str]):
        self._expected = [(f"Bearer {t}".encode(), credential_of(t)) for t in tokens]

    def _credential(self, metadata) -> Optional[str]:
        """The caller's credential, or None if it presented no accepted token."""
        if not self._expected:
            return ""
        got = dict(metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        found = None
        for expected, credential in self._expected:   # every entry, constant time each
            if hmac.compare_digest(got, expected) and found is None:
                found = credential
        return found

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        credential = self._credential(details.invocation_metadata)
        authorized = credential is not None
        parse = handler.request_deserializer
        # Requests arrive as bytes and are parsed here, so a corrupt message is answered with
        # INVALID_ARGUMENT naming the method instead of grpc's generic UNKNOWN.
        async def decode(raw, context):
            if not authorized:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
            try:
                return parse(raw)
            except Exception as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"malformed request to {details.method}: {e}")

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(raw, context):
                request = await decode(raw, context)
                _CALLER.set(credential)
                try:
                    return await inner(request, context)
                except RpcRefusal as e:
                    await abort(context, e)
                except (asyncio.CancelledError, aio.AbortError):
                    raise
                except Exception as e:  # a bug must not take the server down: answer INTERNAL
                    log.exception("%s failed", details.method)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=handler.response_serializer)
        inner_stream = handler.unary_stream
        serialize = handler.response_serializer

        def serialize_or_pass(message):  # Watch may send pre-serialized WatchEvent bytes
            return message if isinstance(message, bytes) else serialize(message)

        async def stream(raw, context):
            request = await decode(raw, context)
            _CALLER.set(credential)
            try:
                await inner_stream(request, context)
            except RpcRefusal as e:
                await abort(context, e)
            except (asyncio.CancelledError, aio.AbortError):
                raise
            except Exception as e:
                log.exception("%s failed", details.method)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        return grpc.unary_stream_rpc_method_handler(stream, response_serializer=serialize_or_pass)


async def abort(context, e: RpcRefusal) -> None:
    """End the RPC with `e`'s status and its trailing metadata (leader hint, job outcome)."""
    metadata = e.trailing_metadata()
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(e.code, e.message)
