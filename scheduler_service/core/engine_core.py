"""The engine core of one worker lane: validates requests, runs the scheduler, turns worker replies
into request outputs, and holds the lane's sequences whether or not a worker is attached.

It is the one door to its scheduler, block manager and detokenizers: callers add, abort and read
stats; steps are built with build_step() and read back with process_step(), so that the step loop
(core/step_loop.py) can launch step N+1 before step N's tokens return.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from itertools import groupby
from operator import attrgetter

from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.block_manager import BlockListener, BlockManager
from scheduler_service.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from scheduler_service.core.errors import QueueFullError, RequestError
from scheduler_service.core.outputs import EngineStats, RequestOutput, merged
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import FinishReason, Sequence
from scheduler_service.core.step_builder import InFlightStep, build_step

logger = logging.getLogger(__name__)
_SEQ_ID_OF = attrgetter("seq_id")


class EngineCore:
    """attach(worker) before the first request; detach() when the worker is lost (its sequences
    wait, reset, to be recomputed on the next attach)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.served: WorkerDescription | None = None  # the last worker attached, as this core serves it
        self.eos_token_ids: frozenset[int] = frozenset()
        self._scheduler: Scheduler | None = None
        self._block_manager: BlockManager | None = None
        self._parked: list[Sequence] = []  # unfinished while detached
        self._past_counts = (0, 0, 0)  # prefix queries, hits, preemptions of earlier workers
        self._next_step_id = 1
        self._block_listener: BlockListener | None = None

    def set_block_listener(self, listener: BlockListener | None) -> None:
        """Who hears this lane's prefix cache change (the block pools of later workers too)."""
        self._block_listener = listener
        if self._block_manager is not None:
            self._block_manager.listener = listener

    # Workers.

    def attach(self, worker: WorkerDescription, num_kv_blocks: int,
               extra_eos_token_ids: Iterable[int] = ()) -> WorkerDescription:
        """Serves a worker that claimed num_kv_blocks: a block pool of that size, its EOS ids with
        extra_eos_token_ids (the tokenizer's); the parked sequences are queued first, in order.
        Returns what this lane serves."""
        config = self.config.within(worker.max_num_seqs, worker.max_num_batched_tokens)
        max_model_len = min(config.max_model_len or worker.max_model_len, worker.max_model_len)
        # A sequence must fit in the whole pool when it runs alone, or it could never finish.
        capacity = num_kv_blocks * worker.block_size
        if capacity < max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: sequences are capped at %d",
                           capacity, max_model_len, capacity)
        self.eos_token_ids = frozenset(worker.eos_token_ids) | frozenset(extra_eos_token_ids)
        self.served = dataclasses.replace(worker, num_kv_blocks=num_kv_blocks,
                                          max_model_len=min(max_model_len, capacity),
                                          eos_token_ids=tuple(sorted(self.eos_token_ids)))
        self._block_manager = BlockManager(num_kv_blocks, worker.block_size, config.enable_prefix_caching,
                                           self._block_listener)
        self._scheduler = Scheduler(config, self._block_manager, self.served.max_model_len)
        self._next_step_id = 1  # a claim starts the worker's step ids over
        for seq in self._parked:
            self._scheduler.add(seq)
        self._parked = []
        return self.served

    def detach(self) -> None:
        """The worker was lost, and nothing it held survives: every unfinished sequence is reset to
        be recomputed from its tokens and waits for the next worker (running ones first)."""
        if self._scheduler is None or self._block_manager is None:
            return
        self._past_counts = self._counts()
        for seq in self._scheduler.take_unfinished():
            self._block_manager.free(seq)
            seq.preempt()
            self._parked.append(seq)
        self._scheduler = self._block_manager = None
        if self._block_listener is not None:  # the worker's cache, and every block in it, is gone
            self._block_listener.cache_cleared()

    def fail_parked(self) -> list[int]:
        """Ends the parked sequences (no worker came back for them); returns their ids."""
        parked, self._parked = self._parked, []
        for seq in parked:
            self._end(seq, FinishReason.ABORTED)
        return [seq.seq_id for seq in parked]

    @property
    def is_attached(self) -> bool:
        return self._scheduler is not None

    # Requests.

    @property
    def max_model_len(self) -> int:
        if self.served is None:
            raise RuntimeError("no worker was attached yet")
        return self.served.max_model_len

    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raises RequestError for a prompt that can never be served. max_model_len is capped at the
        KV cache's capacity, so a prompt within it also fits in the cache."""
        num_prompt, max_model_len = len(prompt_token_ids), self.max_model_len
        if num_prompt == 0:
            raise RequestError("prompt: must not be empty")
        if num_prompt >= max_model_len:
            raise RequestError(f"prompt: {num_prompt} tokens, the limit is {max_model_len - 1} "
                               f"(max_model_len {max_model_len} minus one generated token)")
        vocab_size = self.served.vocab_size  # type: ignore[union-attr]
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    tokenizer: TokenDecoder | None = None) -> Sequence:
        """Queues a request; with a tokenizer its outputs carry text."""
        self.validate(prompt_token_ids)
        scheduler = self._attached_scheduler()
        if scheduler.num_unfinished >= self.config.max_queue_size:
            raise QueueFullError(f"queue: full ({self.config.max_queue_size} requests)")
        detokenizer = None
        if tokenizer is not None:
            detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params.stop,
                                                 params.include_stop_in_output)
        seq = Sequence(list(prompt_token_ids), params, detokenizer=detokenizer)
        scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stops a sequence now: its blocks return to the pool, the worker forgets it next step."""
        if not seq.is_finished:
            if seq in self._parked:
                self._parked.remove(seq)
            self._end(seq, FinishReason.ABORTED)

    @staticmethod
    def text_of(seq: Sequence) -> str:
        """A finished sequence's whole output text ("" without a tokenizer)."""
        return seq.detokenizer.text if seq.detokenizer is not None else ""

    @property
    def num_unfinished(self) -> int:
        return self._scheduler.num_unfinished if self._scheduler is not None else len(self._parked)

    @property
    def has_work(self) -> bool:
        """Unfinished sequences, or released ones the worker has not been told of."""
        scheduler = self._scheduler
        return scheduler is not None and (scheduler.has_unfinished or scheduler.has_released_seq_ids)

    def take_released_seq_ids(self) -> list[int]:
        """Ids the worker should forget now (used when no step is coming to carry them)."""
        return self._attached_scheduler().take_released_seq_ids()

    def stats(self) -> EngineStats:
        """Read from another thread too (the metrics scrape): lengths and counts only, each read
        whole under the GIL, so a snapshot is at worst a step out of date."""
        scheduler, blocks = self._scheduler, self._block_manager
        counts = self._counts()
        if scheduler is None or blocks is None:
            return EngineStats(False, 0, len(self._parked), 0, 0, *counts)
        return EngineStats(True, len(scheduler.running), len(scheduler.waiting), blocks.num_blocks,
                           blocks.num_free_blocks, *counts, block_size=blocks.block_size)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (benchmarks that must start cold)."""
        if self._block_manager is not None:
            self._block_manager.reset_prefix_cache()

    def _counts(self) -> tuple[int, int, int]:
        queries, hits, preemptions = self._past_counts
        if self._scheduler is None or self._block_manager is None:
            return queries, hits, preemptions
        blocks = self._block_manager
        return (queries + blocks.num_prefix_query_tokens, hits + blocks.num_prefix_hit_tokens,
                preemptions + self._scheduler.num_preemptions)

    def _attached_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("no worker is attached")
        return self._scheduler

    def _end(self, seq: Sequence, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        """Finishes seq: through the scheduler while attached (blocks, release), else directly."""
        if self._scheduler is not None:
            self._scheduler.finish(seq, reason, matched_stop)
        else:
            seq.finish(reason, matched_stop)
        if seq.detokenizer is not None:
            seq.detokenizer.finish()

    # Steps.

    def build_step(self) -> InFlightStep | None:
        """Schedules the next step; None when there is nothing to send."""
        output = self._attached_scheduler().schedule()
        if output.is_empty:
            return None
        step_id, self._next_step_id = self._next_step_id, self._next_step_id + 1
        return build_step(step_id, output)

    def observe_period(self, step: InFlightStep, period_s: float) -> None:
        """step's result came period_s after the previous one's, with no idle gap between them."""
        if step.num_decode_steps:
            self._attached_scheduler().observe_decode_period(step.num_decode_steps, period_s)

    def process_step(self, step: InFlightStep, response: worker_pb2.StepResponse) -> list[RequestOutput]:
        """Appends the step's tokens to their sequences and checks stop conditions: one output per
        sequence that got tokens. Tokens of a sequence that stopped or was preempted while the
        step ran are dropped, and so are those after a token that ends its sequence."""
        if response.step_id != step.step_id:
            raise RuntimeError(f"worker answered step {response.step_id} to step {step.step_id}")
        scheduled = step.scheduled
        seq_id_to_output: dict[int, RequestOutput] = {}
        # A reply lists each sequence's tokens together: one group each (a worker that splits them
        # gets the same result, joined).
        for seq_id, samples in groupby(response.tokens, _SEQ_ID_OF):
            seq, epoch = scheduled[seq_id]
            if seq.is_finished or seq.num_preemptions != epoch:
                continue  # stopped or preempted while the step ran: the tokens are dropped
            output = self._append_tokens(seq, samples)
            previous = seq_id_to_output.get(seq_id)
            seq_id_to_output[seq_id] = output if previous is None else merged([previous, output])
        register = self._block_manager.register_computed_blocks  # type: ignore[union-attr]
        for seq, epoch in scheduled.values():
            if not seq.is_finished and seq.num_preemptions == epoch:
                register(seq)
        return list(seq_id_to_output.values())

    def _append_tokens(self, seq: Sequence, samples: Iterable[worker_pb2.SampledToken]) -> RequestOutput:
        """Appends tokens to seq up to the first that ends it, and finishes it then."""
        wants_logprobs = seq.sampling_params.logprobs
        if wants_logprobs:
            samples = list(samples)
        token_ids = [sampled.token_id for sampled in samples]
        reason, matched_stop, num_kept = first_stop(seq, token_ids, self.eos_token_ids, self.max_model_len)
        if num_kept < len(token_ids):
            del token_ids[num_kept:]
        seq.append_tokens(token_ids)
        if reason is not None:
            self._end(seq, reason, matched_stop)
        output = self._output(seq, token_ids, finished=reason is not None)
        if wants_logprobs:
            for sampled in samples[:num_kept]:  # type: ignore[index]
                if sampled.HasField("logprob"):
                    output.logprobs.append(sampled.logprob)
                    output.top_logprobs.append([(t.token_id, t.logprob) for t in sampled.top_logprobs])
        return output

    @staticmethod
    def _output(seq: Sequence, token_ids: list[int], finished: bool) -> RequestOutput:
        """seq's delta for its new tokens (handed on, not copied: nothing else keeps the list)."""
        text = seq.detokenizer.take_delta(finished) if seq.detokenizer is not None else ""
        if not finished:
            return RequestOutput(seq.seq_id, text, token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                                 num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens)
        return RequestOutput(seq.seq_id, text, token_ids, finished=True, finish_reason=seq.finish_reason,
                             matched_stop=seq.matched_stop, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                             queue_time_s=seq.queue_time_s)


def first_stop(seq: Sequence, token_ids: list[int], eos_token_ids: frozenset[int],
               max_model_len: int) -> tuple[FinishReason | None, str | int | None, int]:
    """The first of seq's new tokens that ends it: (why, the stop it matched, how many tokens are
    kept). Each kept token's text is added on the way, so that a completed stop string ends seq
    at once and no later token follows it."""
    params = seq.sampling_params
    stop_token_ids = params.stop_token_ids
    eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
    # LENGTH once the output reaches max_tokens or the sequence max_model_len (a sequence
    # already there ends with its first new token).
    num_left = max(min(seq.num_prompt_tokens + params.max_tokens, max_model_len) - seq.num_tokens, 1)
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
