"""The /metrics HTTP server of the rendezvous server and the launcher: what a client can hold is bounded."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from rendezvous.common import metrics_http
from rendezvous.common.metrics_http import MAX_CONNECTIONS, MetricsServer, parse_request
from tests.waiting import wait_until


@pytest.fixture
def served():
    registry = CollectorRegistry()
    Counter("elastic_test_things", "Things.", registry=registry).inc(3)
    server = MetricsServer(registry, "127.0.0.1", 0)
    yield server
    server.close()


def get(port: int, path: str = "/metrics", method: str = "GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("head, parsed", [
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain", ("GET", "/metrics", "text/plain")),
    (b"GET /metrics?name[]=x HTTP/1.0", ("GET", "/metrics", "")),
    (b"HEAD / HTTP/1.1\nAccept: application/openmetrics-text", ("HEAD", "/", "application/openmetrics-text")),
])
def test_a_request_head_is_parsed_into_method_path_and_accept(head, parsed):
    assert parse_request(head) == parsed


@pytest.mark.parametrize("head", [b"", b"GET /metrics", b"\x16\x03\x01 tls hello", b"GET /metrics SPDY/3"])
def test_what_is_not_an_http_request_line_is_refused(head):
    with pytest.raises(ValueError):
        parse_request(head)


def test_metrics_are_served_as_prometheus_text_and_openmetrics_when_asked(served):
    status, kind, text = get(served.port)
    assert status == 200 and kind.startswith("text/plain") and "elastic_test_things_total 3.0" in text
    out = raw(served.port, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n")
    assert b"application/openmetrics-text" in out and out.rstrip().endswith(b"# EOF")


@pytest.mark.parametrize("path, method, code", [("/other", "GET", 404), ("/metrics", "POST", 405)])
def test_other_paths_and_methods_get_an_http_error(served, path, method, code):
    assert get(served.port, path, method)[0] == code


def test_a_request_head_longer_than_the_limit_is_refused(served):
    out = raw(served.port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (metrics_http.MAX_REQUEST_BYTES + 10))
    assert out.startswith(b"HTTP/1.1 431 ")


def test_a_scrape_gets_through_while_idle_connections_hold_every_slot(served):
    idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(MAX_CONNECTIONS + 20)]
    try:
        wait_until(lambda: served.evicted >= 20, 10, "the server to close the idle connections beyond its cap")
        assert served.open_connections <= MAX_CONNECTIONS
        assert get(served.port)[0] == 200, "a scraper sends its request at once: the oldest idle one makes room"
    finally:
        for s in idle:
            s.close()


def test_an_idle_connection_is_closed_after_the_read_timeout(served, monkeypatch):
    monkeypatch.setattr(metrics_http, "READ_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        assert s.recv(1) == b"", "closed by the server without an answer"
    assert served.open_connections == 0
