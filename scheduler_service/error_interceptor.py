"""The one place where exceptions become gRPC status codes.

Servicers raise; this interceptor aborts the call with the matching code and the exception's
message, for unary and server-streaming methods alike (a stream may fail after some messages).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from scheduler_service.errors import EngineUnavailableError, QueueFullError, WorkerStepError

logger = logging.getLogger(__name__)


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an exception a servicer raised."""
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, WorkerStepError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, ValueError):  # RequestError and SamplingParams' checks: "field: message"
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, details = status_for(exc)
    if code is grpc.StatusCode.INTERNAL and not isinstance(exc, WorkerStepError):  # that one is logged once
        logger.error("%s failed", method, exc_info=exc)
    else:
        logger.debug("%s: %s %s", method, code.name, details)
    await context.abort(code, details)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise  # the servicer aborted with its own status (e.g. health's NOT_FOUND): keep it
        except Exception as exc:
            await _abort(context, method, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            # Closed explicitly when the call ends, so that the servicer's own cleanup (aborting the
            # engine request) runs now rather than when the garbage collector finalizes it.
            async with contextlib.aclosing(behavior(request, context)) as messages:
                async for message in messages:
                    yield message
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)

    return wrapped


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps RequestError/ValueError -> INVALID_ARGUMENT, QueueFullError -> RESOURCE_EXHAUSTED,
    EngineUnavailableError -> UNAVAILABLE, anything else -> INTERNAL (logged with its traceback).
    Cancellation (asyncio.CancelledError) is not an Exception and passes through untouched."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            # An async generator yields its messages; a coroutine (health's Watch) writes them itself.
            stream = handler.unary_stream
            wrap = _wrap_stream if inspect.isasyncgenfunction(stream) else _wrap_unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        # Client- and bidi-streaming methods (only server reflection here) raise nothing to map.
        return handler
