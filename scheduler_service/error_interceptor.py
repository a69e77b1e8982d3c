"""The one place where exceptions become gRPC status codes.

Servicers raise; this interceptor aborts the call with the matching code and the exception's
message, for unary and server-streaming methods alike (a stream may fail after some messages).

It also guards what grpcio would otherwise answer on its own: a request body that does not parse
(not protobuf, or a string field that is not UTF-8) would fail in grpcio's deserializer as UNKNOWN
with a traceback in the log; here the deserializer never raises and the call ends with
INVALID_ARGUMENT. And it admits at most `max_concurrent_calls` calls at once (health checks
aside), refusing the others with RESOURCE_EXHAUSTED naming the limit.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from scheduler_service.errors import (
    EngineUnavailableError,
    OverloadError,
    QueueFullError,
    RequestError,
    WorkerStepError,
)

logger = logging.getLogger(__name__)


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and details for an exception a servicer raised."""
    if isinstance(exc, QueueFullError | OverloadError):
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


class _MalformedRequest:
    """What the guarded deserializer returns for a body that does not parse."""


_MALFORMED = _MalformedRequest()
_MALFORMED_MESSAGE = "request: not a valid protobuf message of this method's request type (or a string field is " \
    "not UTF-8)"


def _guarded(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # protobuf's DecodeError; grpcio would log a traceback and answer UNKNOWN
            return _MALFORMED

    return deserialize


class CallLimiter:
    """Counts calls in progress; admit() refuses one beyond `limit` (OverloadError). One event loop
    runs every call, so the count needs no lock."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.num_calls = 0

    @contextlib.contextmanager
    def admit(self, method: str) -> Iterator[None]:
        if method in _UNLIMITED_METHODS:  # neither refused nor counted (a Watch lasts as long as its client)
            yield
            return
        if self.limit is not None and self.num_calls >= self.limit:
            raise OverloadError(f"server: {self.limit} calls in progress, the limit (--max-concurrent-calls)")
        self.num_calls += 1
        try:
            yield
        finally:
            self.num_calls -= 1


# Load balancers' probes must answer while the server is full.
_UNLIMITED_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def _check_parsed(request: Any) -> None:
    if request is _MALFORMED:
        raise RequestError(_MALFORMED_MESSAGE)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], method: str,
                limiter: CallLimiter) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_parsed(request)
            with limiter.admit(method):
                return await behavior(request, context)
        except grpc.aio.AbortError:
            raise  # the servicer aborted with its own status (e.g. health's NOT_FOUND): keep it
        except Exception as exc:
            await _abort(context, method, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]], method: str,
                 limiter: CallLimiter) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            _check_parsed(request)
            # Closed explicitly when the call ends, so that the servicer's own cleanup (aborting the
            # engine request) runs now rather than when the garbage collector finalizes it.
            with limiter.admit(method):
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
    Cancellation (asyncio.CancelledError) is not an Exception and passes through untouched.
    Unparsable bodies get INVALID_ARGUMENT; calls beyond max_concurrent_calls RESOURCE_EXHAUSTED."""

    def __init__(self, max_concurrent_calls: int | None = None) -> None:
        self.limiter = CallLimiter(max_concurrent_calls)

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
                _wrap_unary(handler.unary_unary, method, self.limiter),
                request_deserializer=_guarded(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            # An async generator yields its messages; a coroutine (health's Watch) writes them itself.
            stream = handler.unary_stream
            wrap = _wrap_stream if inspect.isasyncgenfunction(stream) else _wrap_unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(stream, method, self.limiter),
                request_deserializer=_guarded(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:  # server reflection
            return grpc.stream_stream_rpc_method_handler(
                _wrap_request_stream(handler.stream_stream, method),
                request_deserializer=_guarded(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return handler  # client streaming: no such method here


def _wrap_request_stream(behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
    """A bidirectional stream whose incoming messages are checked as they arrive."""
    async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            _check_parsed(request)
            yield request

    # The stream's body is _wrap_stream's, without a limit (reflection, the only such method here).
    return _wrap_stream(lambda requests, context: behavior(checked(requests), context), method, CallLimiter(None))
