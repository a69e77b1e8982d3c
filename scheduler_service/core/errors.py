"""Errors the engine raises, each meaning one documented status (scheduler_service/api/statuses.py maps
them to gRPC codes)."""
from __future__ import annotations

__all__ = ["EngineUnavailableError", "QueueFullError", "RequestError", "WorkerLostError", "WorkerStepError"]


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
