"""Errors the worker raises, and STATUSES: the gRPC status code of each (common.net.error_mapping's
interceptor aborts the call with it and the error's message)."""
from __future__ import annotations

import grpc

from common.net.error_mapping import StatusMapper
from worker_service.runtime.worker import StepOrderError


class SessionLostError(RuntimeError):
    """The call's session does not hold the worker: taken over, or never claimed on this worker
    process (it restarted). The caller's state here is gone (ABORTED)."""


class ClaimRefusedError(RuntimeError):
    """Another session holds the worker and the claim did not ask to take over (FAILED_PRECONDITION)."""


# A malformed step or claim raises ValueError ("field: message"): INVALID_ARGUMENT with every table.
STATUSES = StatusMapper([(SessionLostError, grpc.StatusCode.ABORTED),
                         (ClaimRefusedError, grpc.StatusCode.FAILED_PRECONDITION),
                         (StepOrderError, grpc.StatusCode.FAILED_PRECONDITION)],
                        "worker: internal error ({name}); see the worker log")
