"""Noticing a gRPC server that stopped by itself, so that its process exits rather than living on deaf.

grpcio 1.85's serving loop fails on a call whose method path is not UTF-8 (before any interceptor
runs, outside our code) and then shuts the whole grpc.aio server down: any client that reaches the
port can cause it. A process whose server is gone must exit non-zero, so that its supervisor
(compose's restart policy, Kubernetes) starts it again; tests/test_server_stops_by_itself.py shows
both the grpcio behaviour and the exit.
"""
from __future__ import annotations

import asyncio
import contextlib

import grpc


async def stopped_by_itself(server: grpc.aio.Server, stop: asyncio.Event) -> bool:
    """Waits until stop is set or the server ends; True when the server ended first."""
    # Never cancelled: grpcio's wait_for_termination() awaits the server's own shutdown future, and
    # cancelling it would fail the server's later stop(). It ends when the server does.
    ended = asyncio.ensure_future(server.wait_for_termination())
    ended.add_done_callback(_retrieve)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait((asyncio.shield(ended), stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    return ended.done() and not stop.is_set()


def _retrieve(ended: asyncio.Future) -> None:
    """Takes the result: grpcio re-raises its serving loop's failure, whose message quotes the call's bytes."""
    with contextlib.suppress(BaseException):
        ended.result()
