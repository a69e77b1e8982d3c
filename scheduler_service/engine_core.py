"""The engine: validates requests, runs the scheduler, turns worker replies into token updates.

A step is split into build_step() and process_step(), so that drive() can launch step N+1 before
step N's tokens return (one step of lookahead): the one loop of the worker lanes and the offline LLM.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field

from common.config import SchedulerConfig, WorkerInfo
from common.generated.nanovllm.worker.v1 import worker_pb2
from common.sampling_params import SamplingParams
from scheduler_service.block_manager import BlockManager
from scheduler_service.detokenizer import IncrementalDetokenizer, TokenDecoder
from scheduler_service.errors import QueueFullError, RequestError
from scheduler_service.scheduler import Scheduler, SchedulerOutput
from scheduler_service.sequence import FinishReason, Sequence
from scheduler_service.step_builder import build_step_request


@dataclass(slots=True)
class TokenUpdate:
    """What one step added to one sequence."""

    seq: Sequence
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finished: bool = False


@dataclass
class InFlightStep:
    """A step sent to the worker whose reply has not been processed yet."""

    step_id: int
    request: worker_pb2.StepRequest
    # For each sequence the step computes: the sequence and its preemption count at the time, so
    # that a token for a sequence preempted since is recognised and dropped.
    scheduled: dict[int, tuple[Sequence, int]]
    # Tokens the worker computes for it (prefill chunks and decode iterations): sizes its deadline.
    num_tokens: int = 0

logger = logging.getLogger(__name__)


def _clamped_to_worker(config: SchedulerConfig, worker: WorkerInfo) -> SchedulerConfig:
    """The scheduler never plans a step larger than the worker is sized for."""
    changes = {}
    if worker.max_num_seqs and worker.max_num_seqs < config.max_num_seqs:
        changes["max_num_seqs"] = worker.max_num_seqs
    if worker.max_num_batched_tokens and worker.max_num_batched_tokens < config.max_num_batched_tokens:
        changes["max_num_batched_tokens"] = worker.max_num_batched_tokens
    return dataclasses.replace(config, **changes) if changes else config


class EngineCore:
    def __init__(self, config: SchedulerConfig, worker_info: WorkerInfo, eos_token_ids: Iterable[int]) -> None:
        config = _clamped_to_worker(config, worker_info)
        self.config = config
        self.worker_info = worker_info
        max_model_len = min(config.max_model_len or worker_info.max_model_len, worker_info.max_model_len)
        # A sequence must fit in the whole pool when it runs alone, or it could never finish.
        capacity = worker_info.num_kv_blocks * worker_info.block_size
        if capacity < max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: sequences are capped at %d",
                           capacity, max_model_len, capacity)
        self.max_model_len = min(max_model_len, capacity)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(worker_info.num_kv_blocks, worker_info.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self._next_step_id = 1

    # Requests.

    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raises RequestError for a prompt that can never be served. max_model_len is capped at the
        KV cache's capacity, so a prompt within it also fits in the cache."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestError("prompt: must not be empty")
        if num_prompt >= self.max_model_len:
            raise RequestError(f"prompt: {num_prompt} tokens, the limit is {self.max_model_len - 1} "
                               f"(max_model_len {self.max_model_len} minus one generated token)")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.worker_info.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, "
                               f"{self.worker_info.vocab_size})")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    tokenizer: TokenDecoder | None = None) -> Sequence:
        """Queues a request; with a tokenizer its text is decoded as tokens arrive (seq.detokenizer)."""
        self.validate(prompt_token_ids)
        if self.scheduler.num_unfinished >= self.config.max_queue_size:
            raise QueueFullError(f"queue: full ({self.config.max_queue_size} requests)")
        detokenizer = None
        if tokenizer is not None:
            detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params.stop,
                                                 params.include_stop_in_output)
        seq = Sequence(list(prompt_token_ids), params, detokenizer=detokenizer)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stops a sequence now: its blocks return to the pool, the worker forgets it next step."""
        self.scheduler.finish(seq, FinishReason.ABORTED)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def take_released_seq_ids(self) -> list[int]:
        """Ids the worker should forget now (used when no step is coming to carry them)."""
        return self.scheduler.take_released_seq_ids()

    def take_unfinished(self) -> list[Sequence]:
        """Removes every unfinished sequence, reset to be recomputed from its tokens (the worker
        was lost, so nothing it held survives). Running ones come first, oldest first."""
        sequences = [*self.scheduler.running, *self.scheduler.waiting]
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        for seq in sequences:
            self.block_manager.free(seq)  # the pool goes with this engine; seq's block table is cleared
            seq.preempt()
        return sequences

    def adopt(self, sequences: list[Sequence]) -> None:
        """Queues sequences taken from another engine, in order, ahead of nothing else."""
        for seq in sequences:
            self.scheduler.add(seq)

    # Steps.

    def build_step(self) -> InFlightStep | None:
        """Schedules the next step; None when there is nothing to send."""
        output: SchedulerOutput = self.scheduler.schedule()
        if output.is_empty:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        request = build_step_request(step_id, output)
        scheduled = {item.seq.seq_id: (item.seq, item.seq.num_preemptions) for item in output.scheduled}
        num_tokens = sum(item.num_tokens for item in output.scheduled)  # decode iterations included
        return InFlightStep(step_id, request, scheduled, num_tokens)

    def process_step(self, step: InFlightStep, response: worker_pb2.StepResponse) -> list[TokenUpdate]:
        if response.step_id != step.step_id:
            raise RuntimeError(f"worker answered step {response.step_id} to step {step.step_id}")
        updates: list[TokenUpdate] = []
        scheduled = step.scheduled
        for sampled in response.tokens:
            seq, epoch = scheduled[sampled.seq_id]
            if seq.is_finished or seq.num_preemptions != epoch:
                continue  # stopped or preempted while the step ran: the token is dropped
            token_id = sampled.token_id
            seq.append_token(token_id)
            update = TokenUpdate(seq, token_id)
            if seq.sampling_params.logprobs and sampled.HasField("logprob"):
                update.logprob = sampled.logprob
                update.top_logprobs = [(t.token_id, t.logprob) for t in sampled.top_logprobs]
            reason, matched_stop = self._stop(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason, matched_stop)
                update.finished = True
            updates.append(update)
        for seq, epoch in step.scheduled.values():
            if not seq.is_finished and seq.num_preemptions == epoch:
                self.block_manager.register_computed_blocks(seq)
        return updates

    def _stop(self, seq: Sequence, token_id: int) -> tuple[FinishReason | None, str | int | None]:
        """Whether the new token ends seq, and the stop it matched. The token's text is added here:
        a completed stop string ends seq at once, so that no later token of the step follows it."""
        params = seq.sampling_params
        reason, matched_stop = None, None
        if token_id in params.stop_token_ids:
            reason, matched_stop = FinishReason.STOP, token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        detokenizer = seq.detokenizer
        if detokenizer is None or (reason is FinishReason.STOP and not params.include_stop_in_output):
            return reason, matched_stop  # the EOS or stop token itself adds no text
        if detokenizer.add_token(token_id) is not None and reason is not FinishReason.STOP:
            return FinishReason.STOP_SEQUENCE, detokenizer.matched_stop
        return reason, matched_stop


async def drive(core: EngineCore,
                launch: Callable[[InFlightStep, InFlightStep | None], Awaitable[worker_pb2.StepResponse]],
                on_step: Callable[[InFlightStep, list[TokenUpdate], float | None], None],
                on_error: Callable[[InFlightStep, BaseException], None] | None = None) -> None:
    """Runs steps until core has nothing unfinished or in flight, step N+1 launched before step N
    is read back. launch(step, ahead) starts a step (ahead: the one in flight before it);
    on_step(step, updates, period_s) gets each step's updates in order, with the time since the
    last result while steps follow with no idle gap; on_error(step, error) sees a failed read-back,
    after the step launched behind the failed one was cancelled (a task) or closed (a coroutine)."""
    in_flight: tuple[InFlightStep, Awaitable[worker_pb2.StepResponse]] | None = None
    last_result: float | None = None
    while core.has_unfinished or in_flight is not None:
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
            updates = core.process_step(done, response)
            now = time.perf_counter()
            on_step(done, updates, None if last_result is None else now - last_result)
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
