"""STATUSES: the gRPC status code of each engine error (common.net.error_mapping's interceptor aborts the
call with it and the error's message)."""
from __future__ import annotations

import grpc

from common.net.error_mapping import StatusMapper
from scheduler_service.core.errors import EngineUnavailableError, QueueFullError, WorkerStepError

# OverloadError -> RESOURCE_EXHAUSTED and ValueError (RequestError, SamplingParams' checks: "field:
# message") -> INVALID_ARGUMENT come with every table.
STATUSES = StatusMapper([(QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
                         (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
                         (WorkerStepError, grpc.StatusCode.INTERNAL)],  # logged once by the engine
                        "internal error ({name}); see the server log")
