"""gRPC channel and server options, set explicitly in one place, and the grpc.aio server both ports build.

A long prefill sends no data frames for seconds: keepalive pings (allowed with no data in between)
let a server notice a vanished client and free its KV blocks (within KEEPALIVE_TIME_MS +
KEEPALIVE_TIMEOUT_MS of its last frame: 25 s), and keep the quiet connection (and the proxies and
NATs between) from being dropped; servers must allow the clients' ping rate, or they
answer the pings with GOAWAY (too_many_pings). Step messages of large batches, long token-id prompts
and responses with top logprobs of long outputs exceed gRPC's 4 MiB default.

What a client can hold of a server's listener is bounded (README, "Listener limits"): a connection
costs a file descriptor and some memory, never a thread (grpc.aio serves every connection from the
event loop and gRPC core's fixed pool of threads).
"""
from __future__ import annotations

import resource
from collections.abc import Mapping

import grpc

from common.net.error_mapping import ErrorMappingInterceptor, StatusMapper

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_TIME_MS = 15_000
KEEPALIVE_TIMEOUT_MS = 10_000
# A connection must finish its TLS handshake and send HTTP/2's preface within this long, or it is
# closed: an idle TCP connection (or a handshake trickled byte by byte) holds its descriptor 20 s,
# not gRPC's default of 120 s. A real client needs milliseconds.
HANDSHAKE_TIMEOUT_MS = 20_000
# A listening address accepts connections up to half the open-file limit, and closes new ones beyond
# at once: clients can never take every descriptor, which the process needs for its own files, its
# links (the scheduler's to its workers) and its other ports (metrics: at most 1,000, HttpLimits).
# A loopback host listens on two addresses (127.0.0.1 and ::1), whose clients are this machine's.
MIN_MAX_CONNECTIONS = 256  # the least it accepts, however low the limit


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


def max_connections_per_address() -> int:
    """The connections one listening address accepts: half the soft open-file limit as it is when the
    server is built (services raise it first: common.net.open_files), at least MIN_MAX_CONNECTIONS."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 2**20
    return max(MIN_MAX_CONNECTIONS, soft // 2)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return channel_options(max_message_bytes) + [
        # Accept client pings as often as every 10 s, even while no call is active; a ping sooner
        # than that earns a strike, and the third strike closes the connection (GOAWAY too_many_pings).
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        # A second server on the same port must fail to bind, not silently share the traffic.
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        ("grpc.max_allowed_incoming_connections", max_connections_per_address()),
    ]


def new_server(statuses: StatusMapper, auth: grpc.aio.ServerInterceptor | None = None, *,
               max_concurrent_calls: int | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
               options: Mapping[str, int] | None = None) -> grpc.aio.Server:
    """A grpc.aio server with server_options (`options` replace or add to them): `auth` first, so that
    a refused call is never parsed, then the error mapping (statuses; at most max_concurrent_calls at once)."""
    interceptors = [] if auth is None else [auth]
    interceptors.append(ErrorMappingInterceptor(statuses, max_concurrent_calls))
    # Merged by key: of two options with one key, grpcio applies the first.
    merged = {**dict(server_options(max_message_bytes)), **(options or {})}
    return grpc.aio.server(interceptors=interceptors, options=list(merged.items()))
