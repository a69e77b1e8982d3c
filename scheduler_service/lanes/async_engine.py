"""The scheduler service's engine: requests in, token deltas out, over one worker lane per worker.

Requests enter through generate(), an async iterator of RequestOutput; each new request goes to the
ready lane with the least outstanding work in tokens (scheduler_service/lanes/lane_loads.py; data
parallelism: one block pool per lane). If the caller stops iterating (client cancelled, deadline
passed) the sequence is aborted at once: its blocks return to the pool and the worker is told to
release it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any

from common.contract.config import SchedulerConfig, WorkerInfo
from common.contract.sampling_params import SamplingParams
from scheduler_service.core.engine_core import TokenUpdate
from scheduler_service.core.errors import EngineUnavailableError, WorkerLostError, WorkerStepError
from scheduler_service.core.sequence import FinishReason, Sequence
from scheduler_service.lanes.lane_loads import Charge, LaneLoads
from scheduler_service.lanes.worker_client import WorkerClient
from scheduler_service.lanes.worker_lane import WorkerLane
from scheduler_service.observe.load_report import LoadReport, load_report
from scheduler_service.observe.metrics import ServiceMetrics

logger = logging.getLogger(__name__)
__all__ = ["AsyncEngine", "LoadReport", "RequestOutput"]


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's output."""

    text: str  # new text; never splits a character, never holds part of a possible stop string
    token_ids: list[int]  # the tokens that produced it (every token, including held-back ones)
    logprobs: list[float] = field(default_factory=list)  # per token, when asked
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time_s: float | None = None  # set on the last output, once the request was ever scheduled


class _Outbox:
    """A request's outputs (or the exception that ends it) not yet taken by its consumer. Cheaper
    than an asyncio.Queue: the consumer takes everything queued at once, and a put only wakes it
    when it waits."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list[RequestOutput | Exception] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | Exception) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[RequestOutput | Exception]:
        """Everything queued, in order; waits for the first item."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self.items = self.items, []
        return items


@dataclass(slots=True)
class _Request:
    seq: Sequence
    lane: WorkerLane
    outputs: _Outbox
    charge: Charge  # its outstanding work on its lane


class AsyncEngine:
    """Created with `await AsyncEngine.start(config, worker_or_workers, tokenizer)`; stopped with
    `await engine.shutdown(grace_seconds)`. Its metrics (engine.metrics, a registry of its own
    unless one is given) are fed by the lanes and read the load report at scrape time."""

    def __init__(self, config: SchedulerConfig, workers: WorkerClient | SequenceABC[WorkerClient],
                 tokenizer: Any | None, eos_token_ids: set[int] | None = None,
                 metrics: ServiceMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        workers = [workers] if not isinstance(workers, SequenceABC) else list(workers)
        if not workers:
            raise ValueError("worker: at least one worker address is needed")
        self.metrics = metrics or ServiceMetrics()
        self._ready = asyncio.Event()
        self.lanes = [WorkerLane(config, worker, set(eos_token_ids or ()), self._dispatch, self._fail_lane,
                                 self._ready.set, self.metrics) for worker in workers]
        self.metrics.set_load_source(self.load)
        self.lane_loads = LaneLoads()
        self._requests: dict[int, _Request] = {}
        self._draining = False

    @classmethod
    async def start(cls, config: SchedulerConfig, workers: WorkerClient | SequenceABC[WorkerClient],
                    tokenizer: Any | None, eos_token_ids: set[int] | None = None,
                    metrics: ServiceMetrics | None = None) -> AsyncEngine:
        engine = cls(config, workers, tokenizer, eos_token_ids, metrics)
        for lane in engine.lanes:
            lane.start()
        return engine

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Returns once some lane has a connected worker."""
        async def until_ready() -> None:
            while not self.ready_lanes:
                self._ready.clear()  # lanes set it whenever one (re)connects
                await self._ready.wait()

        await asyncio.wait_for(until_ready(), timeout)

    @property
    def ready_lanes(self) -> list[WorkerLane]:
        return [lane for lane in self.lanes if lane.is_ready]

    @property
    def is_ready(self) -> bool:
        return bool(self.ready_lanes) and not self._draining

    @property
    def model_info(self) -> WorkerInfo | None:
        lanes = self.ready_lanes or self.lanes
        return next((lane.model_info for lane in lanes if lane.model_info is not None), None)

    @property
    def num_free_blocks(self) -> int:
        return sum(lane.core.block_manager.num_free_blocks for lane in self.ready_lanes)  # type: ignore[union-attr]

    @property
    def num_total_blocks(self) -> int:
        return sum(lane.core.block_manager.num_blocks for lane in self.ready_lanes)  # type: ignore[union-attr]

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def load(self) -> LoadReport:
        """Running and waiting requests and KV usage per worker, as of now (GetLoad, the gauges)."""
        return load_report(self.lanes)

    def _pick_lane(self) -> WorkerLane:
        if self._draining:
            raise EngineUnavailableError("the service is shutting down")
        lanes = self.ready_lanes
        if not lanes:
            raise EngineUnavailableError("no worker is ready")
        return self.lane_loads.least_loaded(lanes)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs. Stopping the iteration early aborts the request at once."""
        lane = self._pick_lane()
        core = lane.core
        assert core is not None  # the lane is ready
        seq = core.add_request(prompt_token_ids, params, self.tokenizer)
        num_prompt = len(prompt_token_ids)
        charge = self.lane_loads.admit(lane, num_prompt, min(params.max_tokens, core.max_model_len - num_prompt))
        request = _Request(seq, lane, _Outbox(), charge)
        self._requests[seq.seq_id] = request
        lane.wakeup.set()
        try:
            while True:
                items = await request.outputs.take()
                for item in items:
                    if isinstance(item, EngineUnavailableError | WorkerStepError):
                        raise type(item)(str(item))  # a documented status: UNAVAILABLE, INTERNAL
                    if isinstance(item, Exception):
                        raise RuntimeError(f"the engine failed: {item!r}") from item
                output = _merge(items)  # type: ignore[arg-type]
                yield output
                if output.finished:
                    return
        finally:
            if not seq.is_finished:
                lane.abort(seq)
            self._requests.pop(seq.seq_id, None)
            self.lane_loads.finish(charge)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuses new requests, lets running ones finish for up to grace_s, aborts the rest. Requests
        parked on a lost worker are not waited for: nothing runs them."""
        self._draining = True
        deadline = asyncio.get_running_loop().time() + grace_s
        while (any(request.lane.is_ready for request in self._requests.values())
               and asyncio.get_running_loop().time() < deadline):
            await asyncio.sleep(0.05)
        for request in list(self._requests.values()):
            request.lane.abort(request.seq)
            if request.lane.is_ready:
                request.outputs.put(self._final_output(request, None))
            else:
                request.outputs.put(WorkerLostError("worker lost: the service is shutting down"))
        await asyncio.gather(*(lane.close() for lane in self.lanes))

    # Outputs.

    def _dispatch(self, updates: list[TokenUpdate]) -> None:
        """One delta per request per step (a step of several decode iterations brings several
        tokens to each: one update)."""
        requests, progress = self._requests, self.lane_loads.progress
        for update in updates:
            request = requests.get(update.seq.seq_id)
            if request is None:
                continue
            progress(request.charge, len(update.token_ids))
            if update.finished:
                request.outputs.put(self._final_output(request, update))
            else:
                request.outputs.put(self._delta(request, update, finished=False))

    def _fail_lane(self, lane: WorkerLane, error: Exception, sequences: list[Sequence] | None) -> None:
        """Ends the lane's requests for sequences (all of them when None) with error."""
        seq_ids = None if sequences is None else {seq.seq_id for seq in sequences}
        for request in list(self._requests.values()):
            if request.lane is lane and (seq_ids is None or request.seq.seq_id in seq_ids):
                request.outputs.put(error)

    def _final_output(self, request: _Request, update: TokenUpdate | None) -> RequestOutput:
        if request.seq.detokenizer is not None:
            request.seq.detokenizer.finish()
        return self._delta(request, update, finished=True)

    @staticmethod
    def _delta(request: _Request, update: TokenUpdate | None, finished: bool) -> RequestOutput:
        """The request's delta for update (None: no new tokens); the update's lists are handed on,
        not copied (nothing else keeps them)."""
        seq = request.seq
        detokenizer = seq.detokenizer
        text = detokenizer.take_delta(finished) if detokenizer is not None else ""
        if update is None:
            update = TokenUpdate(seq)
        return RequestOutput(
            text=text,
            token_ids=update.token_ids,
            logprobs=update.logprobs,
            top_logprobs=update.top_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            matched_stop=seq.matched_stop if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            queue_time_s=seq.queue_time_s if finished else None,
        )


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """Joins deltas that queued up while the consumer was busy into one."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return RequestOutput(
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        logprobs=[p for o in outputs for p in o.logprobs],
        top_logprobs=[p for o in outputs for p in o.top_logprobs],
        finished=last.finished,
        finish_reason=last.finish_reason,
        matched_stop=last.matched_stop,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        queue_time_s=last.queue_time_s,
    )
