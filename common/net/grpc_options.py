"""gRPC channel and server options, set explicitly in one place, and the grpc.aio server both ports build.

A long prefill sends no data frames for seconds: keepalive pings (allowed with no data in between)
let a server notice a vanished client and free its KV blocks (within KEEPALIVE_TIME_MS +
KEEPALIVE_TIMEOUT_MS of its last frame: 25 s), and keep the quiet connection (and the proxies and
NATs between) from being dropped; servers must allow the clients' ping rate, or they
answer the pings with GOAWAY (too_many_pings). Step messages of large batches, long token-id prompts
and responses with top logprobs of long outputs exceed gRPC's 4 MiB default.
"""
from __future__ import annotations

from collections.abc import Mapping

import grpc

from common.net.error_mapping import ErrorMappingInterceptor, StatusMapper

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_TIME_MS = 15_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # grpc 1.85 waits for a ping's ack up to this (default: a minute), whatever the keepalive
        # timeout says: a frozen client's streams lived 80 s, not 30.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return channel_options(max_message_bytes) + [
        # Accept client pings as often as every 10 s, even while no call is active.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        # A second server on the same port must fail to bind, not silently share the traffic.
        ("grpc.so_reuseport", 0),
    ]


def new_server(statuses: StatusMapper, auth: grpc.aio.ServerInterceptor | None = None, *,
               max_concurrent_calls: int | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
               options: Mapping[str, int] | None = None) -> grpc.aio.Server:
    """A grpc.aio server with server_options (and `options` on top): `auth` first, so that a refused
    call is never parsed, then the error mapping (statuses; at most max_concurrent_calls at once)."""
    interceptors = [] if auth is None else [auth]
    interceptors.append(ErrorMappingInterceptor(statuses, max_concurrent_calls))
    return grpc.aio.server(interceptors=interceptors,
                           options=[*server_options(max_message_bytes), *(options or {}).items()])
