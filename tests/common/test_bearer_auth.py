"""The one bearer-token interceptor of both ports: health open, every other call (an unknown method
too) refused with the port's message unless its source accepts the token."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from common.net.error_mapping import StatusMapper
from common.net.grpc_options import new_server
from common.net.ports import PUBLIC_PORT_IN_USE, listen
from common.security.bearer_auth import BearerTokenInterceptor
from common.security.worker_secret import SECRET_REFUSAL, accepts_secret, secret_metadata

SECRET = "s3cret-s3cret-s3cret"


async def _codes(metadata: tuple[tuple[str, str], ...]) -> list[tuple[grpc.StatusCode, str | None]]:
    server = new_server(StatusMapper([], "internal"), BearerTokenInterceptor(accepts_secret(SECRET), SECRET_REFUSAL))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # "" is SERVING
    port = listen(server, "127.0.0.1", 0, None, PUBLIC_PORT_IN_USE)
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = [channel.unary_unary("/grpc.health.v1.Health/Check")(b"", metadata=()),
                     channel.unary_unary("/no.Such/Method")(b"", metadata=metadata)]
            for call in calls:
                try:
                    await call
                    codes.append((grpc.StatusCode.OK, None))
                except grpc.aio.AioRpcError as error:
                    codes.append((error.code(), error.details()))
    finally:
        await server.stop(None)
    return codes


def test_health_is_open_and_an_unknown_method_needs_the_token_too() -> None:
    assert asyncio.run(_codes(())) == [(grpc.StatusCode.OK, None), (grpc.StatusCode.UNAUTHENTICATED, SECRET_REFUSAL)]
    assert asyncio.run(_codes(secret_metadata(SECRET)))[1][0] == grpc.StatusCode.UNIMPLEMENTED
