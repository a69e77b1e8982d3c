"""gRPC channel and server options, set explicitly in one place.

A long prefill sends no data frames for seconds, so keepalive pings keep idle-looking connections
(and the proxies between them) from being dropped; servers must permit those pings. Step messages
of large batches and long prompts exceed gRPC's 4 MiB default.
"""
from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, int]]:
    return channel_options() + [
        # Accept client pings as often as every 10 s, even while no call is active.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ]
