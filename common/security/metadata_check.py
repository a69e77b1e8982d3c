"""Call metadata that gRPC does not allow is refused before anything reads it.

gRPC allows only printable ASCII (0x20-0x7e) in the value of a metadata key not ending in "-bin"
(https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md, ASCII-Value); grpc's own clients
never send anything else, but the server passes on what a raw HTTP/2 client sends: NUL, CR LF,
bytes that are not UTF-8 (decoded as Latin-1, after logging them: common.security.grpc_logs).
Such a call ends with INVALID_ARGUMENT (UNAUTHENTICATED when the value is the `authorization`
header: common.security.bearer_auth), with one DEBUG line that names neither the value nor the key
(a client may put anything in either) nor an unknown method's path.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import grpc

from common.net.error_mapping import Continuation

logger = logging.getLogger(__name__)

ILLEGAL_METADATA = "metadata: a value is not printable ASCII (gRPC allows 0x20-0x7e outside '-bin' keys)"
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


def is_printable_ascii(value: str) -> bool:
    return _PRINTABLE_ASCII.fullmatch(value) is not None


def has_illegal_value(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """True when a value of a key not ending in "-bin" is not printable ASCII (grpc hands binary
    values over as bytes, the others as str)."""
    return any(isinstance(value, str) and not is_printable_ascii(value) for _, value in metadata or ())


def method_name(handler: grpc.RpcMethodHandler | None, method: str) -> str:
    """The method's path when the server has it, else "an unknown method": a path the server does
    not know is whatever the client wrote (it may hold a key), kept out of the log."""
    return method if handler is not None else "an unknown method"


def refusing_handler(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode,
                     message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (unary for an unknown method) that ends the call with
    `code`; it has no request deserializer, so the body is never parsed."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    for kind in ("unary_stream", "stream_unary", "stream_stream"):
        if handler is not None and getattr(handler, kind) is not None:
            return getattr(grpc, f"{kind}_rpc_method_handler")(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def illegal_metadata_refusal(handler: grpc.RpcMethodHandler | None,
                             handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
    """A handler that ends the call with INVALID_ARGUMENT when its metadata has a value gRPC does
    not allow (logged at DEBUG), else None."""
    if not has_illegal_value(handler_call_details.invocation_metadata):
        return None
    logger.debug("%s: INVALID_ARGUMENT (a metadata value is not printable ASCII)",
                 method_name(handler, handler_call_details.method))
    return refusing_handler(handler, grpc.StatusCode.INVALID_ARGUMENT, ILLEGAL_METADATA)


class MetadataCheckInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call with a metadata value gRPC does not allow (INVALID_ARGUMENT), health checks
    included: for a port without credentials (BearerTokenInterceptor checks the same)."""

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return illegal_metadata_refusal(handler, handler_call_details) or handler
