"""Keeps what a client sends out of grpcio's own log records.

grpcio's Cython layer decodes every metadata value (and the method path) as UTF-8; one that is not
makes it log `Invalid encoding on b'<the raw value>'` at ERROR, with a traceback, before the call
reaches any interceptor. A client that sends `authorization: Bearer <key>` plus one 0xff byte
thereby writes the key into the server's log (the worker's secret likewise on the worker port).

GrpcLogFilter drops that record (the bearer interceptor refuses such a call with one DEBUG line of
its own, see common.security.bearer_auth) and, in any other grpcio record, replaces an argument that
is raw bytes by its length. A method path that is not UTF-8 fails in grpcio's serving loop itself
(which then stops the server: a grpcio bug), and asyncio's report of that task quotes the path's
bytes: a grpcio or asyncio record whose exception is a UnicodeDecodeError keeps its traceback, which
names the position of the bad byte only, but not its message. install_grpc_log_filter() puts the filter
on grpcio's loggers and asyncio's; every process calls it at start
(launch.log_format.configure_logging), and so does a server built in-process.
"""
from __future__ import annotations

import logging

# grpcio's record for a string that is not UTF-8 (grpc/_cython/_cygrpc/grpc_string.pyx.pxi).
INVALID_ENCODING_MESSAGE = "Invalid encoding on %s"
# A logging.Filter on a logger sees only the records made on that very logger (not its children's),
# so each of grpcio's loggers gets it; a handler that also carries it (configure_logging's) covers
# loggers grpcio may add later.
GRPC_LOGGERS = ("grpc", "grpc._cython.cygrpc", "grpc._common", "grpc._server", "grpc._channel",
                "grpc._plugin_wrapping", "grpc._utilities", "grpc._simple_stubs", "grpc.aio._server",
                "grpc.aio._call", "grpc.aio._channel", "grpc.aio._interceptor", "grpc._observability", "asyncio")


def _withheld(value: object) -> object:
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes withheld>"
    return value


class GrpcLogFilter(logging.Filter):
    """Drops grpcio's invalid-encoding record and withholds raw bytes from grpcio's other records,
    and the message of a grpcio or asyncio record about bytes that are not UTF-8."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "asyncio" and not record.name.startswith("grpc"):
            return True
        if record.msg == INVALID_ENCODING_MESSAGE:
            return False
        if record.exc_info and isinstance(record.exc_info[1], UnicodeDecodeError):
            record.msg, record.args = "bytes that are not UTF-8 (withheld) failed to decode", None
        elif isinstance(record.args, tuple) and any(isinstance(arg, bytes | bytearray) for arg in record.args):
            record.args = tuple(_withheld(arg) for arg in record.args)
        return True


GRPC_LOG_FILTER = GrpcLogFilter()


def install_grpc_log_filter() -> None:
    """Puts GRPC_LOG_FILTER on grpcio's loggers (those named in GRPC_LOGGERS and any other that exists
    now); calling it again changes nothing. Needs no grpc import: a logger made here by name is the
    one grpcio gets when it is imported later."""
    existing = [name for name in logging.root.manager.loggerDict if name == "grpc" or name.startswith("grpc.")]
    for name in {*GRPC_LOGGERS, *existing}:
        logging.getLogger(name).addFilter(GRPC_LOG_FILTER)
