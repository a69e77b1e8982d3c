"""What a failed worker call means for the requests on that worker.

- LOST: the transport failed (UNAVAILABLE, connection reset, a deadline passed, no heartbeat
  answered, the worker no longer knows our secret). The worker's state is unknown: recompute
  every request once one answers.
- SESSION_LOST: the worker answered ABORTED: it no longer holds our session (another scheduler
  took it over, or it restarted). Same recovery as LOST; the reclaim never takes over.
- PROTOCOL: the worker refused or failed this one call (INVALID_ARGUMENT, FAILED_PRECONDITION,
  INTERNAL, anything else it reports). Only that step's requests fail (INTERNAL); retrying it
  would fail again, so it is never recomputed.
"""
from __future__ import annotations

import enum

import grpc


class WorkerFault(enum.Enum):
    LOST = "lost"
    SESSION_LOST = "session lost"
    PROTOCOL = "protocol error"


_LOST_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAUTHENTICATED})


def classify(error: BaseException) -> WorkerFault | None:
    """The fault a worker call's exception stands for; None when it is not a worker fault (a bug)."""
    if isinstance(error, grpc.aio.AioRpcError):
        code = error.code()
        if code in _LOST_CODES:
            return WorkerFault.LOST
        if code is grpc.StatusCode.ABORTED:
            return WorkerFault.SESSION_LOST
        return WorkerFault.PROTOCOL
    if isinstance(error, ConnectionError | OSError):
        return WorkerFault.LOST
    return None


class WorkerUnresponsiveError(ConnectionError):
    """The worker answered no heartbeat within the liveness bound (lanes/liveness.py)."""


class StepFailedError(RuntimeError):
    """The worker reported a protocol error for a step; its requests were failed already."""
