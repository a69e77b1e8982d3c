"""The engine core of one worker lane: validates requests, runs the scheduler, turns worker replies
into request outputs, and holds the lane's sequences whether or not a worker is attached.

It is the one door to its scheduler, block manager and detokenizers: callers add, abort and read
stats; steps are built with build_step() and read back with process_step(), so that the step loop
(core/step_loop.py) can launch step N+1 before step N's tokens return.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from itertools import groupby
from operator import attrgetter

from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.block_manager import BlockListener, BlockManager
from scheduler_service.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from scheduler_service.core.errors import QueueFullError
from scheduler_service.core.outputs import EngineStats, RequestOutput, merged
from scheduler_service.core.prompt_logprobs import PromptLogprobs
from scheduler_service.core.request_checks import check_prompt, check_token_ids
from scheduler_service.core.samples import sample_params
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.sequence import FinishReason, Sequence, TokenConstraint
from scheduler_service.core.step_builder import InFlightStep, build_step
from scheduler_service.core.stop_conditions import first_stop

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
        self._failed_seq_ids: list[int] = []  # failed by a forbidden token since last taken

    def set_block_listener(self, listener: BlockListener | None) -> None:
        """Who hears this lane's prefix cache change (the block pools of later workers too)."""
        self._block_listener = listener
        if self._block_manager is not None:
            self._block_manager.listener = listener

    # Workers.

    def attach(self, worker: WorkerDescription, num_kv_blocks: int, extra_eos_token_ids: Iterable[int] = (),
               grammars_on_worker: bool = False) -> WorkerDescription:
        """Serves a worker that claimed num_kv_blocks: a block pool of that size, its EOS ids with
        extra_eos_token_ids (the tokenizer's); the parked sequences are queued first, in order.
        grammars_on_worker: the worker was given the grammar tokenizer (InitCache) and advances constrained
        sequences' grammars itself, so they are sent their grammar, not a mask per step. Returns what this
        lane serves."""
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
        self._scheduler = Scheduler(config, self._block_manager, self.served.max_model_len, grammars_on_worker)
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

    @property
    def grammars_on_worker(self) -> bool:
        """Whether the attached worker advances constrained sequences' grammars itself."""
        return self._scheduler is not None and self._scheduler.grammars_on_worker

    # Requests.

    @property
    def max_model_len(self) -> int:
        if self.served is None:
            raise RuntimeError("no worker was attached yet")
        return self.served.max_model_len

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raises RequestError for a prompt (or parameters) that can never be served (request_checks)."""
        check_prompt(prompt_token_ids, self.max_model_len, self.served.vocab_size)  # type: ignore[union-attr]
        if params is not None:
            check_token_ids(params, self.served.vocab_size)  # type: ignore[union-attr]

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    tokenizer: TokenDecoder | None = None,
                    constraint: Callable[[], TokenConstraint] | None = None, *,
                    leader: Sequence | None = None, sample_index: int = 0) -> Sequence:
        """Queues a request; with a tokenizer its outputs carry text. constraint: params.constraint
        compiled (scheduler_service/constraints/ CompiledConstraint.new_state), required with one.
        leader, sample_index: of a sample other than the first (add_samples)."""
        self.validate(prompt_token_ids, params)
        if (params.constraint is None) != (constraint is None):
            raise RuntimeError("add_request: a constraint comes compiled, and only with params.constraint")
        scheduler = self._attached_scheduler()
        if scheduler.num_unfinished >= self.config.max_queue_size:
            raise QueueFullError(f"queue: full ({self.config.max_queue_size} requests)")
        detokenizer = None
        if tokenizer is not None:
            detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params.stop,
                                                 params.include_stop_in_output)
        prompt_logprobs = PromptLogprobs(len(prompt_token_ids)) if params.num_prompt_logprobs is not None else None
        seq = Sequence(list(prompt_token_ids), params, detokenizer=detokenizer,
                       constraint_state=constraint() if constraint is not None else None,
                       prompt_logprobs=prompt_logprobs, leader=leader, sample_index=sample_index)
        scheduler.add(seq)
        return seq

    def add_samples(self, prompt_token_ids: list[int], params: SamplingParams,
                    tokenizer: TokenDecoder | None = None,
                    constraint: Callable[[], TokenConstraint] | None = None) -> list[Sequence]:
        """Queues a request of params.n samples (core/samples.py): n sequences, sample 0 first, each
        with its own parameters, detokenizer and stop state; the others are admitted once sample 0's
        prompt is in the prefix cache. All or none are queued."""
        if params.n == 1:
            return [self.add_request(prompt_token_ids, params, tokenizer, constraint)]
        self.validate(prompt_token_ids, params)
        if self._attached_scheduler().num_unfinished + params.n > self.config.max_queue_size:
            raise QueueFullError(f"queue: full ({self.config.max_queue_size} requests; this one has {params.n} "
                                 "samples)")
        leader = self.add_request(prompt_token_ids, sample_params(params, 0), tokenizer, constraint)
        sequences = [leader]
        for index in range(1, params.n):
            sequences.append(self.add_request(prompt_token_ids, sample_params(params, index), tokenizer, constraint,
                                              leader=leader, sample_index=index))
        return sequences

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

    def take_failed_seq_ids(self) -> list[int]:
        """Sequences that process_step ended because the worker sampled a token their constraint
        forbids (a worker that ignored the mask): their requests fail with an internal error."""
        failed, self._failed_seq_ids = self._failed_seq_ids, []
        return failed

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
        return build_step(step_id, output, self.eos_token_ids)

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
            if output is None:
                continue
            previous = seq_id_to_output.get(seq_id)
            seq_id_to_output[seq_id] = output if previous is None else merged([previous, output])
        for scores in response.prompt_logprobs:
            seq, epoch = scheduled[scores.seq_id]
            if seq.prompt_logprobs is not None and not seq.is_finished:
                seq.prompt_logprobs.add(scores)
        register = self._block_manager.register_computed_blocks  # type: ignore[union-attr]
        for seq, epoch in scheduled.values():
            if not seq.is_finished and seq.num_preemptions == epoch:
                register(seq)
        return list(seq_id_to_output.values())

    def _append_tokens(self, seq: Sequence, samples: Iterable[worker_pb2.SampledToken]) -> RequestOutput | None:
        """Appends tokens to seq up to the first that ends it, and finishes it then. None: a token its
        constraint forbids failed it."""
        wants_logprobs = seq.sampling_params.logprobs
        if wants_logprobs:
            samples = list(samples)
        token_ids = [sampled.token_id for sampled in samples]
        num_valid, is_complete = len(token_ids), False
        if seq.constraint_state is not None:
            num_valid, is_complete = seq.constraint_state.consume(seq, token_ids)
            if num_valid < len(token_ids) and not is_complete:
                self._fail_forbidden(seq, token_ids[num_valid])
                return None
            del token_ids[num_valid:]  # nothing follows a completed grammar
        reason, matched_stop, num_kept = first_stop(seq, token_ids, self.eos_token_ids, self.max_model_len)
        if is_complete and num_kept == len(token_ids) and reason in (None, FinishReason.LENGTH):
            reason, matched_stop = FinishReason.STOP, None  # the grammar allows nothing more
        if num_kept < len(token_ids):
            del token_ids[num_kept:]
        seq.append_tokens(token_ids)
        if seq.constraint_state is not None and num_kept < num_valid:
            # A stop cut a step of several tokens short: consuming nothing rolls the matcher back to
            # the tokens kept, so that it holds exactly the sequence's outputs.
            seq.constraint_state.consume(seq, [])
        if reason is not None:
            self._end(seq, reason, matched_stop)
        output = self._output(seq, token_ids, finished=reason is not None)
        if wants_logprobs:
            for sampled in samples[:num_kept]:  # type: ignore[index]
                if sampled.HasField("logprob"):
                    output.logprobs.append(sampled.logprob)
                    output.top_logprobs.append([(t.token_id, t.logprob) for t in sampled.top_logprobs])
        return output

    def _fail_forbidden(self, seq: Sequence, token_id: int) -> None:
        logger.error("sequence %d: the worker sampled token %d, which its constraint forbids (%s); failing its "
                     "request", seq.seq_id, token_id, seq.constraint_state.error)  # type: ignore[union-attr]
        self._end(seq, FinishReason.ABORTED)
        self._failed_seq_ids.append(seq.seq_id)

    @staticmethod
    def _output(seq: Sequence, token_ids: list[int], finished: bool) -> RequestOutput:
        """seq's delta for its new tokens (handed on, not copied: nothing else keeps the list)."""
        text = seq.detokenizer.take_delta(finished) if seq.detokenizer is not None else ""
        prompt_scores = seq.prompt_logprobs.take() if seq.prompt_logprobs is not None else None
        if not finished:
            return RequestOutput(seq.seq_id, text, token_ids, num_prompt_tokens=seq.num_prompt_tokens,
                                 num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                                 prompt_logprobs=prompt_scores)
        return RequestOutput(seq.seq_id, text, token_ids, finished=True, finish_reason=seq.finish_reason,
                             matched_stop=seq.matched_stop, num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, num_cached_tokens=seq.num_cached_tokens,
                             queue_time_s=seq.queue_time_s, prompt_logprobs=prompt_scores)
