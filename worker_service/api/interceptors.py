"""The worker's shared secret on every call.

SecretInterceptor runs first: a call without the secret is answered UNAUTHENTICATED before its
body is even parsed, so it has no effect. grpc.health.v1 stays open (container health checks know
no secret, and it tells nothing about the model). Then common.net.error_mapping's interceptor maps the
servicer's exceptions (worker_service.api.statuses.STATUSES).
"""
from __future__ import annotations

from typing import Any

import grpc

from common.net.error_mapping import Continuation
from common.security.worker_secret import is_authorized

OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "worker: missing or wrong secret")


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <secret>` on every call but health's."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if (handler_call_details.method.startswith(OPEN_METHOD_PREFIX)
                or is_authorized(handler_call_details.invocation_metadata, self._secret)):
            return await continuation(handler_call_details)
        # No deserializer: the request's bytes are never parsed. Every worker method is unary.
        return grpc.unary_unary_rpc_method_handler(_refuse)
