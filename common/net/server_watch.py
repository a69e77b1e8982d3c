"""Noticing a gRPC server that stopped by itself, so that its process exits rather than living on deaf.

grpcio 1.85's serving loop fails on a call whose method path is not UTF-8 (before any interceptor
runs, outside our code) and then shuts the whole grpc.aio server down: any client that reaches the
port can cause it. A process whose server is gone must exit non-zero, so that its supervisor
(compose's restart policy, Kubernetes) starts it again; tests/test_server_stops_by_itself.py shows
both the grpcio behaviour and the exit.

The exception that serving loop raises, logged by asyncio with its traceback, crashed the worker with
SIGSEGV while CPython 3.11 walked that traceback's Cython frames (seen at 9df1785, in one checkout
directory and not another): exceptions raised in grpcio's Cython code are logged without their
traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from typing import Any

import grpc

logger = logging.getLogger(__name__)
_CYTHON_SOURCES = (".pyx", ".pxi")


async def stopped_by_itself(server: grpc.aio.Server, stop: asyncio.Event) -> bool:
    """Waits until stop is set or the server ends; True when the server ended first. Installs the
    running loop's exception handler (see the module's docstring)."""
    asyncio.get_running_loop().set_exception_handler(_log_without_cython_traceback)
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


def _log_without_cython_traceback(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's default handling, but an exception raised in Cython code is logged as one line."""
    error = context.get("exception")
    if not isinstance(error, BaseException) or not _raised_in_cython(error):
        loop.default_exception_handler(context)
        return
    summary = "".join(traceback.format_exception_only(type(error), error)).strip()
    logger.error("%s: %s", context.get("message", "unhandled exception in the event loop"), summary)


def _raised_in_cython(error: BaseException) -> bool:
    """Whether a frame of error's traceback runs Cython code (its file names only: no line tables read)."""
    frames = error.__traceback__
    while frames is not None:
        if frames.tb_frame.f_code.co_filename.endswith(_CYTHON_SOURCES):
            return True
        frames = frames.tb_next
    return False
