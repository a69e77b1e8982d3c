"""`authorization: Bearer <token>` on every call but health checks, on either port.

One interceptor, two sources of accepted tokens: the public port's API keys
(common.security.api_keys.ApiKeys.accepts) and the worker port's shared secret
(common.security.worker_secret.accepts_secret). It runs first: a refused call gets UNAUTHENTICATED
from a handler without a request deserializer, so its body is never parsed and it has no effect.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from common.net.error_mapping import Continuation, is_health_check

logger = logging.getLogger(__name__)

METADATA_KEY = "authorization"


def authorization_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The call's first `authorization` value, None without one."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def is_bearer_of(authorization: str | None, keys: Iterable[bytes]) -> bool:
    """True when `authorization` is "Bearer <one of keys>" (the scheme in any case). Compared in
    constant time against every key (no early exit), so timing says nothing about which key or how
    much matched."""
    scheme, _, token = (authorization or "").partition(" ")
    presented = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched and scheme.lower() == "bearer"


def _refusing_handler(handler: grpc.RpcMethodHandler | None, refusal: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (unary for an unknown method) that ends the call with
    UNAUTHENTICATED."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

    for kind in ("unary_stream", "stream_unary", "stream_stream"):
        if handler is not None and getattr(handler, kind) is not None:
            return getattr(grpc, f"{kind}_rpc_method_handler")(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks (UNAUTHENTICATED, `refusal` its message) unless
    `accepts` takes its `authorization` value."""

    def __init__(self, accepts: Callable[[str | None], bool], refusal: str) -> None:
        self.accepts = accepts
        self.refusal = refusal

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if is_health_check(method) or self.accepts(authorization_of(handler_call_details.invocation_metadata)):
            return handler
        logger.debug("%s: UNAUTHENTICATED", method)  # never the token itself
        return _refusing_handler(handler, self.refusal)
