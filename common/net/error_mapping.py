"""The one place where a server's exceptions become gRPC status codes, for the public server and
the worker alike.

Servicers raise; the interceptor aborts the call with the code its service's table gives the
exception (the first row it is an instance of) and the exception's message, for unary and
server-streaming methods (a stream may fail after some messages). An exception in no row is a bug:
INTERNAL with a short message, its traceback in the log.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc

logger = logging.getLogger(__name__)

# (exception type, status code) rows, the first match wins: subclasses before their bases.
StatusTable = Sequence[tuple[type[Exception], grpc.StatusCode]]
MALFORMED_MESSAGE = ("request: not a valid protobuf message of this method's request type (or a string field is "
                     "not UTF-8)")
# What a server interceptor's intercept_service gets to call for the method's own handler.
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def is_health_check(method: str) -> bool:
    """grpc.health.v1 is open on either port: load balancers and container checks probe it without
    credentials, and it must answer while the server is full."""
    return method.startswith("/grpc.health.v1.Health/")


class OverloadError(RuntimeError):
    """More calls at once than the server admits (RESOURCE_EXHAUSTED)."""


class StatusMapper:
    """A service's table and how it names an unexpected error (`internal_message`, with {name})."""

    def __init__(self, table: StatusTable, internal_message: str) -> None:
        self.table = [(OverloadError, grpc.StatusCode.RESOURCE_EXHAUSTED), *table,
                      (ValueError, grpc.StatusCode.INVALID_ARGUMENT)]  # "field: message", malformed bodies
        self.internal_message = internal_message

    def status_for(self, error: Exception) -> tuple[grpc.StatusCode, str, bool]:
        """(code, details, expected): expected is False for an error no row maps (a bug)."""
        for error_type, code in self.table:
            if isinstance(error, error_type):
                return code, str(error), True
        return grpc.StatusCode.INTERNAL, self.internal_message.format(name=type(error).__name__), False

    async def abort(self, context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
        code, details, expected = self.status_for(error)
        if expected:
            logger.debug("%s: %s %s", method, code.name, details)
        else:
            logger.error("%s failed", method, exc_info=error)
        await context.abort(code, details)


class _MalformedRequest:
    """What the guarded deserializer returns for a body that does not parse."""


_MALFORMED = _MalformedRequest()


def _guarded(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception:  # protobuf's DecodeError; grpcio would log a traceback and answer UNKNOWN
            return _MALFORMED

    return deserialize


def _check_parsed(request: Any) -> None:
    if request is _MALFORMED:
        raise ValueError(MALFORMED_MESSAGE)


class CallLimiter:
    """Counts calls in progress; admit() refuses one beyond `limit` (OverloadError). One event loop
    runs every call, so the count needs no lock."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.num_calls = 0

    @contextlib.contextmanager
    def admit(self, method: str) -> Iterator[None]:
        if is_health_check(method):  # neither refused nor counted (a Watch lasts as long as its client)
            yield
            return
        if self.limit is not None and self.num_calls >= self.limit:
            raise OverloadError(f"server: {self.limit} calls in progress, the limit (--max-concurrent-calls)")
        self.num_calls += 1
        try:
            yield
        finally:
            self.num_calls -= 1


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions through `statuses`; cancellation (asyncio.CancelledError) is not an Exception
    and passes through untouched. Unparsable bodies get INVALID_ARGUMENT; calls beyond
    max_concurrent_calls RESOURCE_EXHAUSTED."""

    def __init__(self, statuses: StatusMapper, max_concurrent_calls: int | None = None) -> None:
        self.statuses = statuses
        self.limiter = CallLimiter(max_concurrent_calls)

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        wrap: Callable[[Callable[..., Any], str, CallLimiter], Callable[..., Any]] | None = None
        if handler.unary_unary is not None:
            behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
            wrap = self._wrap_unary
        elif handler.unary_stream is not None:
            # An async generator yields its messages; a coroutine (health's Watch) writes them itself.
            behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
            wrap = self._wrap_stream if inspect.isasyncgenfunction(behavior) else self._wrap_unary
        elif handler.stream_stream is not None:  # server reflection
            behavior, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
            wrap = self._wrap_request_stream
        if wrap is None:
            return handler  # client streaming: no such method here
        return make(wrap(behavior, method, self.limiter), request_deserializer=_guarded(handler.request_deserializer),
                    response_serializer=handler.response_serializer)

    def _wrap_unary(self, behavior: Callable[..., Awaitable[Any]], method: str,
                    limiter: CallLimiter) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                _check_parsed(request)
                with limiter.admit(method):
                    return await behavior(request, context)
            except grpc.aio.AbortError:
                raise  # the servicer aborted with its own status (e.g. health's NOT_FOUND): keep it
            except Exception as error:
                await self.statuses.abort(context, method, error)

        return wrapped

    def _wrap_stream(self, behavior: Callable[..., AsyncIterator[Any]], method: str,
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
            except Exception as error:
                await self.statuses.abort(context, method, error)

        return wrapped

    def _wrap_request_stream(self, behavior: Callable[..., AsyncIterator[Any]], method: str,
                             limiter: CallLimiter) -> Callable[..., AsyncIterator[Any]]:
        """A bidirectional stream whose incoming messages are checked as they arrive; no limit
        (reflection, the only such method here)."""
        async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for request in requests:
                _check_parsed(request)
                yield request

        return self._wrap_stream(lambda requests, context: behavior(checked(requests), context), method,
                                 CallLimiter(None))
