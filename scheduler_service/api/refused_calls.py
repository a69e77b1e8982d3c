"""Calls the public port refused for want of a valid API key, made visible without flooding the log.

Each refusal counts in nanovllm_request_failure_total{code="UNAUTHENTICATED"} (whatever the method)
and in a window: the first refusal after a quiet spell opens one, and when it closes, `interval_s`
later, one INFO line says how many calls it refused. So a client retrying with a wrong key many
times a second, or someone trying keys, costs one line per interval, never the key (nor anything
else the client sent).
"""
from __future__ import annotations

import asyncio
import logging
import time

from scheduler_service.observe.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 60.0


def calls(count: int) -> str:
    return f"{count} call" if count == 1 else f"{count} calls"


class RefusedCalls:
    """The bearer interceptor's on_refused callback for the public port: call it on the server's
    event loop, once per refused call."""

    def __init__(self, metrics: ServiceMetrics, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.num_refused = 0  # in the open window
        self._window_start = 0.0
        self._flush: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self.metrics.recording:
            self.metrics.request_failure.labels("UNAUTHENTICATED").inc()
        self.num_refused += 1
        if self._flush is None:
            self._window_start = time.monotonic()
            self._flush = asyncio.get_running_loop().call_later(self.interval_s, self.flush)

    def flush(self) -> None:
        """Logs the open window's count now and closes it (at the window's end, and when the server stops)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self.num_refused:
            logger.info("refused %s without a valid API key in the last %.3g s", calls(self.num_refused),
                        time.monotonic() - self._window_start)
            self.num_refused = 0
