"""Keeps what a client sends out of grpcio's own log records.

grpcio's Cython layer decodes every metadata value (and the method path) as UTF-8; one that is not
makes it log `Invalid encoding on b'<the raw value>'` at ERROR, with a traceback, before the call
reaches any interceptor. A client that sends `authorization: Bearer <key>` plus one 0xff byte
thereby writes the key into the server's log (the worker's secret likewise on the worker port).

GrpcLogFilter drops that record (the bearer interceptor refuses such a call with one DEBUG line of
its own, see common.security.bearer_auth) and, in any other grpcio record, replaces an argument that
is raw bytes by its length. install_grpc_log_filter() puts it on grpcio's loggers; every process
calls it at start (launch.log_format.configure_logging), and so does a server built in-process.
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
                "grpc.aio._call", "grpc.aio._channel", "grpc.aio._interceptor", "grpc._observability")


def _withheld(value: object) -> object:
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes withheld>"
    return value


class GrpcLogFilter(logging.Filter):
    """Drops grpcio's invalid-encoding record and withholds raw bytes from grpcio's other records."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("grpc"):
            return True
        if record.msg == INVALID_ENCODING_MESSAGE:
            return False
        if isinstance(record.args, tuple) and any(isinstance(arg, bytes | bytearray) for arg in record.args):
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
