"""Errors the engine raises, and STATUSES: the gRPC status code of each (common.net.error_mapping's
interceptor aborts the call with it and the error's message)."""
from __future__ import annotations

import grpc

from common.net.error_mapping import OverloadError, StatusMapper

__all__ = ["STATUSES", "EngineUnavailableError", "OverloadError", "QueueFullError", "RequestError",
           "WorkerLostError", "WorkerStepError"]


class RequestError(ValueError):
    """A request the engine can never serve (INVALID_ARGUMENT); the message names the field and
    the limit, e.g. "max_tokens: must be >= 1, got 0"."""


class QueueFullError(RuntimeError):
    """Too many requests are queued (RESOURCE_EXHAUSTED)."""


class EngineUnavailableError(RuntimeError):
    """No worker is ready, or the service is draining (UNAVAILABLE)."""


class WorkerLostError(EngineUnavailableError):
    """The request's worker was lost and none came back within the worker timeout (UNAVAILABLE)."""


class WorkerStepError(RuntimeError):
    """The worker reported a protocol error for the request's step (INTERNAL, logged once by the
    engine, not once per request)."""


# OverloadError -> RESOURCE_EXHAUSTED and ValueError (RequestError, SamplingParams' checks: "field:
# message") -> INVALID_ARGUMENT come with every table.
STATUSES = StatusMapper([(QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
                         (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
                         (WorkerStepError, grpc.StatusCode.INTERNAL)],  # logged once by the engine
                        "internal error ({name}); see the server log")
