"""One request as the public server saw it: its timings, its metrics, and its one log line.

The servicer wraps each Generate / GenerateStream call in `with RequestRecord(...) as record:` and
hands it every engine output; when the call ends, however it ends (finished, an error status, the
client cancelled, the deadline passed), the record counts it in the metrics and logs one line:
request id, the served model's name, the client's W3C traceparent when valid, token counts, finish
reason or status code, TTFT, e2e and queue time. Never the prompt or the output text.

A request of n samples is one request here too: one line, one count; its TTFT is the first token of
any sample, its completion tokens those of every sample; the finish reason, prompt, cached tokens and
queue time are sample 0's, and inter-token latencies are measured along sample 0's deltas.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from types import TracebackType
from typing import Any

import grpc

from scheduler_service.api.statuses import STATUSES
from scheduler_service.core.outputs import RequestOutput
from scheduler_service.observe.metrics import ServiceMetrics

logger = logging.getLogger("nanovllm.requests")

# A client's deadline passes a little before the server's: grpc core rounds the grpc-timeout it sends
# up (to 10 ms under 10 s, 100 ms under 100 s, and so on: up to about 1%), and the header travels. So
# the cancellation the client sends when its deadline passes usually reaches the server first, while
# the server's deadline is still ahead: a cancellation within this slack of the deadline is the
# deadline's (DEADLINE_EXCEEDED, as the client saw), not the client's choice (CANCELLED).
DEADLINE_SLACK_S = 0.05
DEADLINE_SLACK_FRACTION = 0.02  # of the time the call had when it arrived

# version-traceid-parentid-flags, lowercase hex (https://www.w3.org/TR/trace-context/#traceparent-header).
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def valid_traceparent(value: str | None) -> str | None:
    """The header if it is a well-formed W3C traceparent, else None (so that garbage a client sends
    never reaches the logs). Version ff and all-zero ids are invalid by the spec."""
    if value is None:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, parent_id, _ = match.groups()
    if version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return value


def traceparent_of(context: grpc.aio.ServicerContext) -> str | None:
    metadata = context.invocation_metadata() or ()
    return valid_traceparent(next((value for key, value in metadata if key == "traceparent"), None))


class RequestRecord:
    """Timings and counts of one call; a context manager that records the call's end."""

    def __init__(self, metrics: ServiceMetrics, method: str, request_id: str,
                 context: grpc.aio.ServicerContext, model: str | None = None) -> None:
        self.metrics = metrics
        self.model = model  # the served model name (None before any worker connected)
        self.recording = metrics.recording
        self.method = method
        self.request_id = request_id
        self.context = context
        self.traceparent = traceparent_of(context)
        self.arrival = time.perf_counter()
        self.budget_s = context.time_remaining()  # None: the call has no deadline
        self.first_token_time: float | None = None
        self.last_output_time = 0.0
        self.last: RequestOutput | None = None
        self.num_output_tokens = 0
        self.inter_token_latencies: list[float] = []  # binned into the histogram at the end

    def __enter__(self) -> RequestRecord:
        return self

    def on_output(self, output: RequestOutput) -> None:
        """Per delta: kept to a clock read, an append and a few additions (about 0.5 us)."""
        if output.index:
            self._on_other_sample(output)
            return
        self.last = output
        num_tokens = len(output.token_ids)
        if not num_tokens:
            return
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
            if self.recording:
                self.metrics.time_to_first_token.observe(now - self.arrival)
                self.metrics.counters.prompt_tokens += output.num_prompt_tokens
        elif self.recording:
            self.inter_token_latencies.append((now - self.last_output_time) / num_tokens)
        self.last_output_time = now
        self.num_output_tokens += num_tokens
        if self.recording:
            self.metrics.counters.generation_tokens += num_tokens

    def _on_other_sample(self, output: RequestOutput) -> None:
        """A delta of a sample other than sample 0: its tokens count, and its first may be the request's."""
        num_tokens = len(output.token_ids)
        if not num_tokens:
            return
        if self.first_token_time is None:
            self.first_token_time = self.last_output_time = time.perf_counter()
            if self.recording:
                self.metrics.time_to_first_token.observe(self.first_token_time - self.arrival)
                self.metrics.counters.prompt_tokens += output.num_prompt_tokens
        self.num_output_tokens += num_tokens
        if self.recording:
            self.metrics.counters.generation_tokens += num_tokens

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        code = self._status(exc)
        finish_reason = None
        if code is None:
            finish_reason = self.last.finish_reason.name.lower() if self.last and self.last.finish_reason else None
        e2e = time.perf_counter() - self.arrival
        if self.recording:
            self._record(code, finish_reason, e2e)
        self._log(code or "OK", finish_reason, e2e)

    def _status(self, exc: BaseException | None) -> str | None:
        """None for a call that finished; else the status code the client gets."""
        if exc is None:
            return None
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            return "DEADLINE_EXCEEDED" if self._deadline_passed() else "CANCELLED"
        if isinstance(exc, grpc.aio.AbortError):
            code = self.context.code()
            return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        if isinstance(exc, Exception):
            return STATUSES.status_for(exc)[0].name
        return "CANCELLED"

    def _deadline_passed(self) -> bool:
        """Whether the call's deadline has passed, or so nearly that the cancellation is the client's
        deadline (DEADLINE_SLACK_S)."""
        remaining = self.context.time_remaining()
        if remaining is None or self.budget_s is None:
            return False
        return remaining <= DEADLINE_SLACK_S + DEADLINE_SLACK_FRACTION * self.budget_s

    def _record(self, code: str | None, finish_reason: str | None, e2e: float) -> None:
        metrics, last = self.metrics, self.last
        if code is None:
            metrics.request_success.labels(finish_reason or "unknown").inc()
        else:
            metrics.request_failure.labels(code).inc()
        metrics.inter_token_latency.observe_many(self.inter_token_latencies)
        if last is not None and last.finished:
            metrics.e2e_request_latency.observe(e2e)
            metrics.request_prompt_tokens.observe(last.num_prompt_tokens)
            metrics.request_generation_tokens.observe(self.num_output_tokens)  # every sample's
            if last.queue_time_s is not None:
                metrics.request_queue_time.observe(last.queue_time_s)

    def _log(self, status: str, finish_reason: str | None, e2e: float) -> None:
        last = self.last
        fields: dict[str, Any] = {
            "request_id": self.request_id,
            "model": self.model,
            "method": self.method,
            "status": status,
            "finish_reason": finish_reason,
            "prompt_tokens": last.num_prompt_tokens if last else 0,
            "completion_tokens": self.num_output_tokens,
            "cached_tokens": last.num_cached_tokens if last else 0,
            "ttft_s": None if self.first_token_time is None else round(self.first_token_time - self.arrival, 6),
            "e2e_s": round(e2e, 6),
            "queue_time_s": None if last is None or last.queue_time_s is None else round(last.queue_time_s, 6),
        }
        if self.traceparent is not None:
            fields["traceparent"] = self.traceparent
        logger.info("request finished", extra={"fields": fields})
