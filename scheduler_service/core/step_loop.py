"""The one step loop, of the worker lanes and of the offline LLM: step N+1 is launched before step
N's tokens are read back (one step of lookahead)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine

from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.outputs import RequestOutput
from scheduler_service.core.step_builder import InFlightStep


async def drive(core: EngineCore,
                launch: Callable[[InFlightStep, InFlightStep | None], Awaitable[worker_pb2.StepResponse]],
                on_step: Callable[[InFlightStep, list[RequestOutput], float | None], None],
                on_error: Callable[[InFlightStep, BaseException], None] | None = None) -> None:
    """Runs steps until core has nothing unfinished or in flight, step N+1 launched before step N
    is read back. launch(step, ahead) starts a step (ahead: the one in flight before it);
    on_step(step, outputs, period_s) gets each step's outputs in order, with the time since the
    last result while steps follow with no idle gap; on_error(step, error) sees a failed read-back,
    after the step launched behind the failed one was cancelled (a task) or closed (a coroutine)."""
    in_flight: tuple[InFlightStep, Awaitable[worker_pb2.StepResponse]] | None = None
    last_result: float | None = None
    while core.num_unfinished or in_flight is not None:
        step = core.build_step()
        ahead = in_flight[0] if in_flight is not None else None
        launched = (step, launch(step, ahead)) if step is not None else None
        if in_flight is not None:
            done, pending = in_flight
            try:
                response = await pending
            except BaseException as error:
                if launched is not None:  # the step after the failed one is never read back
                    _discard(launched[1])
                if on_error is not None:
                    on_error(done, error)
                raise
            outputs = core.process_step(done, response)
            now = time.perf_counter()
            period_s = None if last_result is None else now - last_result
            if period_s is not None:
                core.observe_period(done, period_s)
            on_step(done, outputs, period_s)
            last_result = now if launched is not None else None
        elif launched is None:
            raise RuntimeError("requests are waiting but none can be scheduled")
        in_flight = launched


def _discard(launched: Awaitable[worker_pb2.StepResponse]) -> None:
    """Stops a launched step whose reply will not be read: cancels a task, closes a coroutine."""
    if isinstance(launched, asyncio.Future):
        launched.cancel()
    elif isinstance(launched, Coroutine):
        launched.close()
