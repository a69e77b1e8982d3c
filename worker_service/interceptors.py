"""The worker's two interceptors: the shared secret on every call, and the one place where
exceptions become status codes.

SecretInterceptor runs first: a call without the secret is answered UNAUTHENTICATED before its
body is even parsed, so it has no effect. grpc.health.v1 stays open (container health checks know
no secret, and it tells nothing about the model). ErrorInterceptor maps the servicer's exceptions;
anything unexpected becomes INTERNAL with a short message, its traceback in the worker's log only.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from common.worker_link import is_authorized
from worker_service.errors import ClaimRefusedError, SessionLostError, StepOrderError

logger = logging.getLogger(__name__)
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


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


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an exception the worker servicer raised."""
    if isinstance(error, SessionLostError):
        return grpc.StatusCode.ABORTED, str(error)
    if isinstance(error, ClaimRefusedError | StepOrderError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error)
    if isinstance(error, ValueError):  # a malformed step or claim: "field: message"
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode.INTERNAL, f"worker: internal error ({type(error).__name__}); see the worker log"


def _wrap(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            code, details = status_for(error)
            if code is grpc.StatusCode.INTERNAL:
                logger.error("%s failed", method, exc_info=error)
            else:
                logger.info("%s: %s %s", method, code.name, details)
            await context.abort(code, details)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """SessionLostError -> ABORTED, ClaimRefusedError/StepOrderError -> FAILED_PRECONDITION,
    ValueError -> INVALID_ARGUMENT, anything else -> INTERNAL (logged with its traceback)."""

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler  # health's streaming Watch raises nothing to map
        return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, handler_call_details.method),
                                                   request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
