"""`authorization: Bearer <token>` on every call but health checks, on either port.

One interceptor, two sources of accepted tokens: the public port's API keys
(common.security.api_keys.ApiKeys.accepts) and the worker port's shared secret
(common.security.worker_secret.accepts_secret). It runs first: a refused call gets UNAUTHENTICATED
from a handler without a request deserializer, so its body is never parsed and it has no effect.
It also refuses metadata gRPC does not allow (common.security.metadata_check): an `authorization`
value that is not printable ASCII (a valid key followed by a 0xff byte, a NUL, CR LF) is refused
like a wrong one, with one DEBUG line that never holds the value.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable

import grpc

from common.net.error_mapping import Continuation, is_health_check
from common.security.metadata_check import (
    illegal_metadata_refusal,
    is_printable_ascii,
    method_name,
    refusing_handler,
)

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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks (UNAUTHENTICATED, `refusal` its message) unless
    `accepts` takes its `authorization` value, and any call whose `authorization` value is not
    printable ASCII (health checks too: gRPC allows no other). A call it lets through with another
    illegal metadata value gets INVALID_ARGUMENT (common.security.metadata_check).

    `on_refused`, when given, is called once per UNAUTHENTICATED refusal (the public port counts
    them in its metrics); this module knows nothing of either service."""

    def __init__(self, accepts: Callable[[str | None], bool], refusal: str,
                 on_refused: Callable[[], None] | None = None) -> None:
        self.accepts = accepts
        self.refusal = refusal
        self.on_refused = on_refused

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        authorization = authorization_of(handler_call_details.invocation_metadata)
        method = method_name(handler, handler_call_details.method)
        if authorization is not None and not is_printable_ascii(authorization):
            return self._refuse(handler, method, " (its authorization value is not printable ASCII)")
        if not is_health_check(handler_call_details.method) and not self.accepts(authorization):
            return self._refuse(handler, method, "")
        return illegal_metadata_refusal(handler, handler_call_details) or handler

    def _refuse(self, handler: grpc.RpcMethodHandler | None, method: str, reason: str) -> grpc.RpcMethodHandler:
        logger.debug("%s: UNAUTHENTICATED%s", method, reason)  # never the token itself
        if self.on_refused is not None:
            self.on_refused()
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, self.refusal)
