"""Token auth and input validation: bad, malformed (fuzzed) and unauthenticated requests get the right
status code with a message, and the server stays up and answers the next good request."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdzv_helpers import ServerThread, server_config
from rendezvous._proto import rendezvous_pb2 as pb
from rendezvous._proto import rendezvous_pb2_grpc as pb_grpc
from rendezvous.store import MemoryStore

TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
METHODS = ["Join", "Heartbeat", "Leave", "ReportFailure", "ReportSuccess", "Status"]
# Codes a well-behaved server may answer bad input with; never INTERNAL/UNKNOWN (a bug).
REJECTIONS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def server():
    s = ServerThread(server_config(insecure=False, token=TOKEN, max_jobs=64), MemoryStore)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.RendezvousStub(channel)
    channel.close()


def assert_alive(stub):
    assert stub.Status(pb.StatusRequest(), timeout=5, metadata=AUTH).leader_id


def code_of(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def good_join(job="good", worker="w0"):
    return pb.JoinRequest(job_id=job, worker_id=worker, host="h", ring_address="127.0.0.1:1234",
                          committed_step=-1, spec=pb.JobSpec(min_np=1, max_np=4))


def test_requests_without_token_are_unauthenticated(stub):
    for method, req in [("Join", good_join()), ("Status", pb.StatusRequest()),
                        ("Leave", pb.LeaveRequest(session_id="good/w0/0"))]:
        code, details = code_of(getattr(stub, method), req, timeout=5)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details, method
    code, _ = code_of(lambda: list(stub.Watch(pb.WatchRequest(session_id="x/y/0"), timeout=5)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert_alive(stub)


@FUZZ
@given(token=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=64))
def test_wrong_tokens_are_unauthenticated(stub, token):
    md = (("authorization", f"Bearer {token}"),) if token != TOKEN else ()
    code, _ = code_of(stub.Join, good_join(), timeout=5, metadata=md)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert_alive(stub)


@pytest.mark.parametrize("field,value", [
    ("job_id", ""), ("job_id", "a/b"), ("job_id", "x" * 129), ("worker_id", "w 1"),
    ("host", ""), ("ring_address", "nohostport"), ("ring_address", "h:0"), ("ring_address", "h:99999"),
    ("committed_step", -2),
    # `$` also matches before a trailing newline: the checks must match the whole value.
    ("job_id", "job\n"), ("worker_id", "w\n"), ("host", "h\n"), ("ring_address", "1.2.3.4:80\n")])
def test_invalid_join_fields_are_named_in_invalid_argument(stub, field, value):
    req = good_join("validation")
    setattr(req, field, value)
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    assert_alive(stub)


@pytest.mark.parametrize("spec,expected", [
    (pb.JobSpec(min_np=0, max_np=1), "min_np"), (pb.JobSpec(min_np=3, max_np=2), "max_np"),
    (pb.JobSpec(min_np=1, max_np=1, elastic_timeout_s=-1), "elastic_timeout_s"),
    (pb.JobSpec(min_np=1, max_np=1, elastic_timeout_s=float("nan")), "elastic_timeout_s")])
def test_invalid_job_specs_are_invalid_argument(stub, spec, expected):
    req = good_join("specs")
    req.spec.CopyFrom(spec)
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in details


def test_spec_mismatch_with_existing_job_is_failed_precondition(stub):
    stub.Join(good_join("mismatch", "a"), timeout=5, metadata=AUTH)
    req = good_join("mismatch", "b")
    req.spec.max_np = 7
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "max_np=4" in details


def test_unknown_and_malformed_sessions(stub):
    code, details = code_of(stub.Heartbeat, pb.HeartbeatRequest(session_id="nojob/w/0"), timeout=5,
                            metadata=AUTH)
    assert code == grpc.StatusCode.NOT_FOUND and "nojob" in details
    code, details = code_of(stub.Leave, pb.LeaveRequest(session_id="garbage"), timeout=5,
                            metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details
    code, details = code_of(stub.Leave, pb.LeaveRequest(session_id="good/w0/\u00b2"), timeout=5,
                            metadata=AUTH)  # a unicode digit must not reach int()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details


@FUZZ
@given(field=st.sampled_from(["job_id", "worker_id", "host", "ring_address"]),
       suffix=st.sampled_from(["\n", "\r\n", " ", "\t", "\x00", "\u2028"]))
def test_fuzzed_trailing_characters_after_a_valid_field_are_refused(stub, field, suffix):
    req = good_join("suffixes")
    setattr(req, field, getattr(req, field) + suffix)
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    code, details = code_of(stub.Leave, pb.LeaveRequest(session_id="good/w0/0" + suffix),
                            timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details


def test_oversized_request_is_refused(stub):
    req = good_join("big")
    req.host = "h" * (2 << 20)
    code, _ = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_alive(stub)


text = st.text(max_size=300)


@FUZZ
@given(job=text, worker=text, host=text, addr=text, step=st.integers(-2 ** 63, 2 ** 63 - 1),
       min_np=st.integers(0, 2 ** 32 - 1), max_np=st.integers(0, 2 ** 32 - 1),
       timeout=st.floats(allow_nan=True, allow_infinity=True))
def test_fuzzed_joins_never_crash_the_server(stub, job, worker, host, addr, step, min_np, max_np,
                                             timeout):
    req = pb.JoinRequest(job_id=job, worker_id=worker, host=host, ring_address=addr,
                         committed_step=step,
                         spec=pb.JobSpec(min_np=min_np, max_np=max_np, elastic_timeout_s=timeout))
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code in REJECTIONS | {grpc.StatusCode.OK}, (code, details)
    assert_alive(stub)


@FUZZ
@given(session=text, version=st.integers(0, 2 ** 64 - 1), suspect=text, reason=st.text(max_size=2000))
def test_fuzzed_session_calls_never_crash_the_server(stub, session, version, suspect, reason):
    calls = [(stub.Heartbeat, pb.HeartbeatRequest(session_id=session, committed_step=version % 10)),
             (stub.Leave, pb.LeaveRequest(session_id=session)),
             (stub.ReportSuccess, pb.ReportSuccessRequest(session_id=session)),
             (stub.ReportFailure, pb.ReportFailureRequest(session_id=session, world_version=version,
                                                          suspect_worker_id=suspect,
                                                          reason=reason))]
    for fn, req in calls:
        code, details = code_of(fn, req, timeout=5, metadata=AUTH)
        assert code in REJECTIONS, (code, details)
    code, _ = code_of(lambda: list(stub.Watch(pb.WatchRequest(session_id=session), timeout=5,
                                              metadata=AUTH)))
    assert code in REJECTIONS
    assert_alive(stub)


@FUZZ
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=512))
def test_fuzzed_raw_bytes_never_crash_the_server(server, stub, method, payload):
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary(f"/elastic.rendezvous.v1.Rendezvous/{method}")  # bytes in, bytes out
        code, details = code_of(call, payload, timeout=5, metadata=AUTH)
    assert code in REJECTIONS | {grpc.StatusCode.OK}, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in details:
        assert method in details
    assert_alive(stub)
