"""The metrics port's HTTP listener under clients that hold on: thousands of idle connections cost no
thread and leave /metrics answering, idle and trickling (slowloris) connections are cut at their
timeouts, an oversized head gets 431, a reply nobody reads is dropped; and the HTTP it speaks (HEAD,
405, keep-alive, Connection: close, pipelining)."""
from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from scheduler_service.observe.http_listener import HttpLimits
from scheduler_service.observe.metrics import ServiceMetrics
from scheduler_service.observe.metrics_server import MetricsServer
from tests.idle_connections import IdleConnections, need_open_files, num_threads
from tests.loop_thread import metrics_served
from tests.services_harness import wait_until

NUM_IDLE = 5_000
GET_METRICS = b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[MetricsServer]:
    """A metrics server on a loop of its own, with the test's HttpLimits (parametrize indirectly)."""
    limits = getattr(request, "param", HttpLimits())
    with metrics_served(ServiceMetrics().registry, is_serving=lambda: True, limits=limits) as server:
        yield server


def connect(server: MetricsServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one reply, read by its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65_536)
        assert chunk, f"closed before a reply's head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65_536)
        assert chunk, "closed within a reply's body"
        body += chunk
    assert len(body) == length, "more bytes than the reply's Content-Length"
    return int(status_line.split(" ")[1]), headers, body


def seconds_until_closed(sock: socket.socket, limit_s: float, *, trickle: bytes = b"") -> float:
    """Seconds until the server closes sock, at most limit_s (then fails); with trickle, one byte of
    it sent each second meanwhile (a slowloris)."""
    started = time.monotonic()
    sock.settimeout(1.0)
    for byte in [trickle[i:i + 1] for i in range(len(trickle))] or [b""] * int(limit_s + 1):
        if byte:
            try:
                sock.sendall(byte)
            except ConnectionError:
                return time.monotonic() - started
        try:
            if not sock.recv(65_536):
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionError:
            return time.monotonic() - started
        if time.monotonic() - started > limit_s:
            break
    raise AssertionError(f"still open after {time.monotonic() - started:.1f} s")


def test_5000_idle_connections_cost_no_thread_and_leave_metrics_answering(served: MetricsServer) -> None:
    need_open_files(2 * NUM_IDLE + 500)  # both ends are in this process
    threads_before = num_threads()
    max_connections = served.listener.limits.max_connections
    with IdleConnections(served.port, NUM_IDLE) as idle:
        # At the limit each new connection closes the longest idle one: the oldest are closed.
        wait_until(lambda: idle.num_closed() >= NUM_IDLE - max_connections, timeout=60,
                   what="the connections beyond the limit closed")
        assert served.listener.num_connections == max_connections
        assert num_threads() <= threads_before + 2  # the old server: a thread per connection
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{served.port}/metrics", timeout=10) as response:
            assert response.status == 200 and b"# TYPE nanovllm_request_success_total" in response.read()
        assert time.monotonic() - started < 5
        assert idle.num_closed() <= NUM_IDLE - max_connections + 1  # the scrape closed at most one more
    wait_until(lambda: served.listener.num_connections == 0, timeout=30, what="every connection gone")


@pytest.mark.parametrize("served", [HttpLimits(idle_timeout_s=1.5)], indirect=True)
def test_idle_connections_are_closed_after_the_idle_timeout(served: MetricsServer) -> None:
    opened = time.monotonic()
    with IdleConnections(served.port, 200) as idle:
        wait_until(lambda: idle.num_closed() == 200, timeout=20, what="the idle connections closed")
        assert time.monotonic() - opened >= 1.5
    kept_alive = connect(served)
    kept_alive.sendall(GET_METRICS)
    assert read_reply(kept_alive)[0] == 200
    assert 1.4 <= seconds_until_closed(kept_alive, limit_s=10) <= 8  # after a reply, the same wait
    kept_alive.close()
    assert served.listener.num_connections == 0


@pytest.mark.parametrize("served", [HttpLimits(head_timeout_s=3.0)], indirect=True)
def test_a_slowloris_is_cut_at_the_head_timeout(served: MetricsServer) -> None:
    sock = connect(served)
    elapsed = seconds_until_closed(sock, limit_s=15, trickle=GET_METRICS[:-2] + b"X-Slow: 1\r\n" * 5)
    sock.close()
    assert 2.5 <= elapsed <= 9, elapsed  # from the first byte, one byte a second


def test_an_oversized_head_gets_431_and_a_head_within_the_bound_is_served(served: MetricsServer) -> None:
    for size, status in ((6_000, 200), (20_000, 431)):
        sock = connect(served)
        sock.sendall(GET_METRICS[:-2] + b"X-Pad: " + b"a" * size + b"\r\n\r\n")
        assert read_reply(sock)[0] == status, size
        if status == 431:
            assert sock.recv(100) == b""  # and the connection closed
        sock.close()


def big_registry() -> CollectorRegistry:
    """A registry whose scrape is a few MB, more than the sockets' buffers hold."""
    registry = CollectorRegistry()
    gauge = Gauge("padding", "a series per label value", ["name"], registry=registry)
    for index in range(30_000):
        gauge.labels(f"series-{index:06d}-{'x' * 60}").set(index)
    return registry


def test_a_reply_the_client_does_not_read_is_dropped_after_the_write_timeout() -> None:
    limits = HttpLimits(write_timeout_s=1.0)
    with metrics_served(big_registry(), limits=limits) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(GET_METRICS * 4)  # and reads nothing
        wait_until(lambda: server.listener.num_connections == 1, timeout=10, what="the connection served")
        wait_until(lambda: server.listener.num_connections == 0, timeout=30, what="the stalled reply dropped")
        sock.close()


@pytest.mark.parametrize("served", [HttpLimits(max_connections=3)], indirect=True)
def test_at_the_connection_limit_the_longest_waiting_connection_makes_room(served: MetricsServer) -> None:
    with IdleConnections(served.port, 3) as idle:
        wait_until(lambda: served.listener.num_connections == 3, timeout=10, what="3 connections")
        sock = connect(served)
        sock.sendall(GET_METRICS)
        assert read_reply(sock)[0] == 200
        wait_until(lambda: idle.num_closed() == 1, timeout=10, what="one idle connection closed")
        assert idle.closed == {0}
        sock.close()


def test_head_405_keep_alive_connection_close_and_pipelining(served: MetricsServer) -> None:
    sock = connect(served)
    sock.sendall(GET_METRICS)
    status, headers, body = read_reply(sock)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    sock.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: test\r\n\r\n")  # the same connection: kept alive
    sock.settimeout(2)
    head = sock.recv(65_536)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert f"Content-Length: {len(body)}\r\n".encode() in head  # and no body
    sock.sendall(b"GET /health HTTP/1.1\r\n\r\nGET /nothing HTTP/1.1\r\n\r\n")  # pipelined
    assert read_reply(sock)[::2] == (200, b"SERVING\n")
    assert read_reply(sock)[0] == 404
    sock.sendall(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    status, headers, _ = read_reply(sock)
    assert status == 200 and headers["connection"] == "close"
    assert sock.recv(100) == b""
    sock.close()
    for request, status in ((b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405),
                            (b"GET /metrics HTTP/1.0\r\n\r\n", 200),  # one request a connection
                            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
                            (b"GET /metrics HTTP/1.1\r\nBad Header: x\r\n\r\n", 400)):
        sock = connect(served)
        sock.sendall(request)
        got, headers, _ = read_reply(sock)
        assert (got, headers["connection"]) == (status, "close"), request
        if status == 405:
            assert headers["allow"] == "GET, HEAD"
        assert sock.recv(100) == b""
        sock.close()
