"""The listener bounds of common/net/grpc_options.py, applied by this grpcio: a server closes the
connections beyond its limit at once and idle ones at its handshake timeout (the real ports' values,
and 5,000 idle connections against them, are tests/test_listener_limits.py); options given to
new_server replace server_options' own."""
from __future__ import annotations

import resource
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.net.error_mapping import StatusMapper
from common.net.grpc_options import HANDSHAKE_TIMEOUT_MS, max_connections_per_address, new_server, server_options
from tests.idle_connections import IdleConnections
from tests.loop_thread import LoopThread
from tests.services_harness import wait_until

LIMIT = 8
HANDSHAKE_S = 1.5


def test_server_options_bound_handshakes_and_connections() -> None:
    options = dict(server_options())
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert options["grpc.server_handshake_timeout_ms"] == HANDSHAKE_TIMEOUT_MS == 20_000
    assert options["grpc.max_allowed_incoming_connections"] == max_connections_per_address() == max(256, soft // 2)


@pytest.fixture
def port() -> Iterator[int]:
    """A health service on a server with the limits shrunk (LIMIT connections, HANDSHAKE_S), on a loop thread."""
    loop = LoopThread("grpc-limits")

    async def start() -> tuple[grpc.aio.Server, int]:
        server = new_server(StatusMapper([], "internal error ({name})"),
                            options={"grpc.max_allowed_incoming_connections": LIMIT,
                                     "grpc.server_handshake_timeout_ms": int(HANDSHAKE_S * 1000)})
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        bound = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, bound

    server, bound = loop.run(start())
    try:
        yield bound
    finally:
        loop.run(server.stop(None))
        loop.close()


def check(port: int) -> grpc.StatusCode:
    """A health check on a new connection."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_connections_beyond_the_limit_are_closed_and_idle_ones_at_the_handshake_timeout(port: int) -> None:
    opened = time.monotonic()
    with IdleConnections(port, LIMIT + 2) as idle:
        wait_until(lambda: idle.num_closed() == 2 and idle.num_answered() == LIMIT, timeout=10,
                   what="the limit's connections answered, the others closed")
        assert check(port) == grpc.StatusCode.UNAVAILABLE  # no room for a new connection
        wait_until(lambda: idle.num_closed() == LIMIT + 2, timeout=HANDSHAKE_S + 10, what="the handshake timeout")
        assert time.monotonic() - opened >= HANDSHAKE_S - 0.1
        assert check(port) == grpc.StatusCode.OK
