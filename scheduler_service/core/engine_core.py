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
from itertools import groupby
from operator import attrgetter

from common.contract.config import SchedulerConfig, WorkerInfo
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from scheduler_service.core.errors import QueueFullError, RequestError
from scheduler_service.core.scheduler import Scheduler, SchedulerOutput
from scheduler_service.core.sequence import FinishReason, Sequence
from scheduler_service.core.step_builder import build_step_request


@dataclass(slots=True)
class TokenUpdate:
    """What one step added to one sequence: its new tokens in order (several for a step of several
    decode iterations), their logprobs when asked, and whether the last of them ended it."""

    seq: Sequence
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # for the tokens that carry one
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
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
    # Its decode iterations when it runs decodes alone (0 when it prefills): its period is timed.
    num_decode_iterations: int = 0

logger = logging.getLogger(__name__)
_SEQ_ID_OF = attrgetter("seq_id")


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
        scheduled = {}
        num_tokens = 0  # decode iterations included
        decodes_only = True
        for item in output.scheduled:
            seq = item.seq
            scheduled[seq.seq_id] = (seq, seq.num_preemptions)
            num_tokens += item.num_tokens
            decodes_only = decodes_only and item.num_tokens == item.num_samples
        num_decode_iterations = output.num_decode_steps if decodes_only and output.scheduled else 0
        return InFlightStep(step_id, request, scheduled, num_tokens, num_decode_iterations)

    def observe_period(self, step: InFlightStep, period_s: float) -> None:
        """step's result came period_s after the previous one's, with no idle gap between them."""
        if step.num_decode_iterations:
            self.scheduler.observe_decode_period(step.num_decode_iterations, period_s)

    def process_step(self, step: InFlightStep, response: worker_pb2.StepResponse) -> list[TokenUpdate]:
        """Appends the step's tokens to their sequences and checks stop conditions: one update per
        sequence that got tokens. Tokens of a sequence that stopped or was preempted while the
        step ran are dropped, and so are those after a token that ends its sequence."""
        if response.step_id != step.step_id:
            raise RuntimeError(f"worker answered step {response.step_id} to step {step.step_id}")
        scheduled = step.scheduled
        seq_id_to_update: dict[int, TokenUpdate] = {}
        # A reply lists each sequence's tokens together: one group each (a worker that splits them
        # gets the same result, joined).
        for seq_id, samples in groupby(response.tokens, _SEQ_ID_OF):
            seq, epoch = scheduled[seq_id]
            if seq.is_finished or seq.num_preemptions != epoch:
                continue  # stopped or preempted while the step ran: the tokens are dropped
            update = self._append_tokens(seq, samples)
            previous = seq_id_to_update.get(seq_id)
            seq_id_to_update[seq_id] = update if previous is None else _joined(previous, update)
        register = self.block_manager.register_computed_blocks
        for seq, epoch in scheduled.values():
            if not seq.is_finished and seq.num_preemptions == epoch:
                register(seq)
        return list(seq_id_to_update.values())

    def _append_tokens(self, seq: Sequence, samples: Iterable[worker_pb2.SampledToken]) -> TokenUpdate:
        """Appends tokens to seq up to the first that ends it, and finishes it then."""
        wants_logprobs = seq.sampling_params.logprobs
        if wants_logprobs:
            samples = list(samples)
        token_ids = [sampled.token_id for sampled in samples]
        reason, matched_stop, num_kept = self._first_stop(seq, token_ids)
        if num_kept < len(token_ids):
            del token_ids[num_kept:]
        seq.append_tokens(token_ids)
        if reason is not None:
            self.scheduler.finish(seq, reason, matched_stop)
        update = TokenUpdate(seq, token_ids, finished=reason is not None)
        if wants_logprobs:
            for sampled in samples[:num_kept]:  # type: ignore[index]
                if sampled.HasField("logprob"):
                    update.logprobs.append(sampled.logprob)
                    update.top_logprobs.append([(t.token_id, t.logprob) for t in sampled.top_logprobs])
        return update

    def _first_stop(self, seq: Sequence, token_ids: list[int]) -> tuple[FinishReason | None, str | int | None, int]:
        """The first of seq's new tokens that ends it: (why, the stop it matched, how many tokens are
        kept). Each kept token's text is added on the way, so that a completed stop string ends seq
        at once and no later token follows it."""
        params = seq.sampling_params
        stop_token_ids = params.stop_token_ids
        eos_token_ids = () if params.ignore_eos else self.eos_token_ids
        # LENGTH once the output reaches max_tokens or the sequence max_model_len (a sequence
        # already there ends with its first new token).
        num_left = max(min(seq.num_prompt_tokens + params.max_tokens, self.max_model_len) - seq.num_tokens, 1)
        detokenizer = seq.detokenizer
        if detokenizer is None and not stop_token_ids and not eos_token_ids:
            if num_left <= len(token_ids):
                return FinishReason.LENGTH, None, num_left
            return None, None, len(token_ids)
        stop_adds_text = params.include_stop_in_output  # else the EOS or stop token adds no text
        for index, token_id in enumerate(token_ids):
            reason, matched_stop = None, None
            if token_id in stop_token_ids:
                reason, matched_stop = FinishReason.STOP, token_id
            elif token_id in eos_token_ids:
                reason = FinishReason.STOP
            elif index + 1 >= num_left:
                reason = FinishReason.LENGTH
            if detokenizer is not None and (reason is not FinishReason.STOP or stop_adds_text):
                if detokenizer.add_token(token_id) is not None and reason is not FinishReason.STOP:
                    reason, matched_stop = FinishReason.STOP_SEQUENCE, detokenizer.matched_stop
            if reason is not None:
                return reason, matched_stop, index + 1
        return None, None, len(token_ids)


def _joined(first: TokenUpdate, second: TokenUpdate) -> TokenUpdate:
    return TokenUpdate(first.seq, first.token_ids + second.token_ids, first.logprobs + second.logprobs,
                       first.top_logprobs + second.top_logprobs, second.finished)


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
            period_s = None if last_result is None else now - last_result
            if period_s is not None:
                core.observe_period(done, period_s)
            on_step(done, updates, period_s)
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
