"""The asynchronous engine loop of the scheduler service.

One task drives the workers: it keeps one step in flight ahead (step N+1 is on the wire before step
N's tokens return), feeds sampled tokens to per-request queues, detokenizes incrementally, and
applies stop strings. Requests enter through generate(), an async iterator of RequestOutput; if
the caller stops iterating (client cancelled, deadline passed) the sequence is aborted at once:
its blocks return to the pool and the worker is told to release it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.config import SchedulerConfig
from common.sampling_params import SamplingParams
from scheduler_service.engine_core import EngineCore, InFlightStep, TokenUpdate
from scheduler_service.errors import EngineUnavailableError
from scheduler_service.llm import worker_info_from
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.worker_client import WorkerClient

logger = logging.getLogger(__name__)
RECONNECT_DELAY_S = 1.0


@dataclass
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


@dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_kv_blocks: int


@dataclass
class _Request:
    seq: Sequence
    outputs: asyncio.Queue[RequestOutput]


class AsyncEngine:
    """Created with `await AsyncEngine.start(config, worker, tokenizer)`; stopped with
    `await engine.shutdown(grace_seconds)`. Reconnects to a lost worker by itself: requests in
    progress are recomputed from the tokens the scheduler holds, so none is lost."""

    def __init__(self, config: SchedulerConfig, worker: WorkerClient, tokenizer: Any | None,
                 eos_token_ids: set[int] | None = None) -> None:
        self.config = config
        self.worker = worker
        self.tokenizer = tokenizer
        self.extra_eos_token_ids = set(eos_token_ids or ())
        self.core: EngineCore | None = None
        self.model_info: ModelInfo | None = None
        self._requests: dict[int, _Request] = {}
        self._orphans: list[Sequence] = []  # unfinished while no worker is connected
        self._wakeup = asyncio.Event()
        self._ready = asyncio.Event()
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, config: SchedulerConfig, worker: WorkerClient, tokenizer: Any | None,
                    eos_token_ids: set[int] | None = None) -> AsyncEngine:
        engine = cls(config, worker, tokenizer, eos_token_ids)
        engine._task = asyncio.create_task(engine._run(), name="engine-loop")
        return engine

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def is_ready(self) -> bool:
        return self.core is not None and not self._draining

    @property
    def num_free_blocks(self) -> int:
        return self.core.block_manager.num_free_blocks if self.core else 0

    @property
    def num_total_blocks(self) -> int:
        return self.core.block_manager.num_blocks if self.core else 0

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._require_ready().validate(prompt_token_ids, params)

    def _require_ready(self) -> EngineCore:
        if self._draining:
            raise EngineUnavailableError("the service is shutting down")
        if self.core is None:
            raise EngineUnavailableError("no worker is ready")
        return self.core

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs. Stopping the iteration early aborts the request at once."""
        seq = self._require_ready().add_request(prompt_token_ids, params, self.tokenizer)
        request = _Request(seq, asyncio.Queue())
        self._requests[seq.seq_id] = request
        self._wakeup.set()
        try:
            while True:
                items = [await request.outputs.get(), *_drain(request.outputs)]
                failure = next((item for item in items if isinstance(item, Exception)), None)
                if failure is not None:
                    raise RuntimeError(f"the engine failed: {failure!r}") from failure
                output = _merge(items)
                yield output
                if output.finished:
                    return
        finally:
            if not seq.is_finished:
                self._abort(seq)
            self._requests.pop(seq.seq_id, None)

    def _abort(self, seq: Sequence) -> None:
        if self.core is not None:
            self.core.abort(seq)
        else:
            seq.status = type(seq.status).FINISHED
            seq.finish_reason = FinishReason.ABORTED
        self._wakeup.set()  # so that the worker is told to release it even when idle

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuses new requests, lets running ones finish for up to grace_s, aborts the rest."""
        self._draining = True
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request in list(self._requests.values()):
            self._abort(request.seq)
            request.outputs.put_nowait(self._final_output(request, []))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.worker.close()

    # The loop.

    async def _run(self) -> None:
        while True:
            try:
                await self._connect()
                await self._drive()
            except (grpc.aio.AioRpcError, ConnectionError, OSError) as error:
                logger.warning("worker %s lost (%s); its requests will be recomputed once it is back",
                               self.worker.address, error)
                self._on_worker_lost()
                await asyncio.sleep(RECONNECT_DELAY_S)
            except Exception as error:  # a bug: fail the requests in progress rather than hang them
                logger.exception("engine loop failed; failing %d requests and starting over", len(self._requests))
                self._fail_all(error)
                self._on_worker_lost()
                self._orphans = []
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def _connect(self) -> None:
        while True:
            try:
                describe = await self.worker.describe()
                break
            except grpc.aio.AioRpcError as error:
                logger.info("waiting for worker %s: %s", self.worker.address, error.code().name)
                await asyncio.sleep(RECONNECT_DELAY_S)
        reply = await self.worker.init_cache(describe.num_kv_blocks)
        info = worker_info_from(describe, reply.num_kv_blocks)
        eos = set(describe.eos_token_ids) | self.extra_eos_token_ids
        core = EngineCore(self.config, info, eos)
        core.adopt([seq for seq in self._orphans if not seq.is_finished])
        self._orphans = []
        self.model_info = ModelInfo(info.model_name, core.max_model_len, info.vocab_size, tuple(sorted(eos)),
                                    info.block_size, info.num_kv_blocks)
        self.core = core
        self._ready.set()
        logger.info("worker %s ready: %s, %d KV blocks of %d tokens, max_model_len %d", self.worker.address,
                    info.model_name, info.num_kv_blocks, info.block_size, core.max_model_len)

    def _on_worker_lost(self) -> None:
        if self.core is not None:
            self._orphans = self.core.take_unfinished()
        self.core = None
        self._ready.clear()

    async def _drive(self) -> None:
        core = self.core
        assert core is not None
        in_flight: tuple[InFlightStep, asyncio.Task] | None = None
        while True:
            if in_flight is None and not core.has_unfinished:
                await self._idle(core)
                continue
            step = core.build_step()
            task = asyncio.create_task(self.worker.step(step.request)) if step is not None else None
            if in_flight is not None:
                try:
                    response = await in_flight[1]
                except BaseException:
                    if task is not None:
                        task.cancel()
                    raise
                self._dispatch(core, core.process_step(in_flight[0], response))
            elif step is None:
                raise RuntimeError("requests are waiting but none can be scheduled")
            in_flight = (step, task) if step is not None else None

    async def _idle(self, core: EngineCore) -> None:
        released = core.take_released_seq_ids()
        if released:
            await self.worker.release(released)
        self._wakeup.clear()
        if not core.has_unfinished and not core.scheduler._to_release:
            await self._wakeup.wait()

    def _dispatch(self, core: EngineCore, updates: list[TokenUpdate]) -> None:
        """One delta per request per step (a step of several decode iterations brings several
        tokens to each)."""
        seq_id_to_updates: dict[int, list[TokenUpdate]] = {}
        for update in updates:
            seq_id_to_updates.setdefault(update.seq.seq_id, []).append(update)
        for seq_id, seq_updates in seq_id_to_updates.items():
            request = self._requests.get(seq_id)
            if request is None:
                continue
            if seq_updates[-1].finished:
                request.outputs.put_nowait(self._final_output(request, seq_updates))
            else:
                request.outputs.put_nowait(self._delta(request, seq_updates, finished=False))

    def _fail_all(self, error: Exception) -> None:
        """Ends every request in progress with an error (their streams get INTERNAL)."""
        for request in list(self._requests.values()):
            request.outputs.put_nowait(error)  # type: ignore[arg-type]

    def _final_output(self, request: _Request, updates: list[TokenUpdate]) -> RequestOutput:
        if request.seq.detokenizer is not None:
            request.seq.detokenizer.finish()
        return self._delta(request, updates, finished=True)

    @staticmethod
    def _delta(request: _Request, updates: list[TokenUpdate], finished: bool) -> RequestOutput:
        seq = request.seq
        detokenizer = request.seq.detokenizer
        text = detokenizer.take_delta(finished) if detokenizer is not None else ""
        return RequestOutput(
            text=text,
            token_ids=[u.token_id for u in updates],
            logprobs=[u.logprob for u in updates if u.logprob is not None],
            top_logprobs=[u.top_logprobs for u in updates if u.logprob is not None],
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            matched_stop=seq.matched_stop if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )


def _drain(queue: asyncio.Queue[RequestOutput]) -> list[RequestOutput]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


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
    )
