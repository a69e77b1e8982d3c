"""A request's state as the scheduler owns it: token ids, block table and counters."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NamedTuple, Protocol

from common.contract.lookahead import num_sampled_tokens
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.prompt_logprobs import PromptLogprobs


class TokenConstraint(Protocol):
    """A constrained sequence's place in its grammar (structured output; scheduler_service/constraints/
    implements it). It consumes exactly the output tokens the sequence holds, so that it survives
    preemption and recompute with them."""

    def consume(self, seq: Sequence, token_ids: list[int]) -> tuple[int, bool]:
        """Consumes seq's new tokens up to the first that completes the grammar: (how many it consumed,
        whether the grammar allows nothing more). Fewer than all and not complete: the next is forbidden."""

    def write_mask(self, seq: Sequence, mask: worker_pb2.TokenMask) -> None:
        """Sets mask to the tokens seq may sample next."""

    @property
    def grammar_text(self) -> str:
        """The grammar its matcher was built from, for a worker that advances it itself."""

    @property
    def error(self) -> str:
        """Why the last token was refused."""


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(Enum):
    LENGTH = auto()  # max_tokens or the context limit
    STOP = auto()  # EOS or a stop token id
    STOP_SEQUENCE = auto()  # a stop string
    ABORTED = auto()  # cancelled, deadline passed, or shut down


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request. Token ids are the prompt followed by every output token so far.

    num_computed_tokens counts tokens whose K/V are in the cache; tokens beyond it are still to be
    computed (a prompt or its rest, or the last sampled token during decode). Fields change only
    through the transitions below (admit, schedule, append_tokens, preempt, finish), except the
    block table and block hashes, which belong to the BlockManager.
    """

    token_ids: list[int]
    sampling_params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks registered in the prefix cache, in order.
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    # How much of the block table the worker has seen; -1: the worker does not hold the sequence.
    num_blocks_on_worker: int = -1
    # Whether the worker sampled this sequence's last token and has not computed it yet: the next
    # step then carries no token ids for it.
    worker_holds_last_token: bool = False
    num_preemptions: int = 0
    # Tokens being sampled by steps in flight, not yet in token_ids (0 or 1 with one step of
    # lookahead). The worker knows them; the scheduler learns them from the step's reply.
    num_pending_tokens: int = 0
    # Turns output tokens into text and watches for stop strings (None: token ids only).
    detokenizer: Any = None
    # Gathers the prompt tokens' log-probabilities when the request asked.
    prompt_logprobs: PromptLogprobs | None = None
    # time.monotonic() when queued, and when first admitted to a step (for the queue-time metric).
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    # Parallel samples (n > 1, core/samples.py): which sample of its request this is, and, for all
    # but sample 0, sample 0's sequence, whose prompt they wait for so as to share its cached blocks.
    sample_index: int = 0
    leader: Sequence | None = None
    # Structured output: the grammar's state, advanced with every appended token (None: free text).
    constraint_state: TokenConstraint | None = None

    @property
    def queue_time_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens_total(self) -> int:
        """Tokens the sequence will hold once the steps in flight return."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt must be computed, not served by the prefix cache, until every score arrived."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.is_complete

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_scheduled_tokens_total - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_on_worker(self) -> bool:
        return self.num_blocks_on_worker >= 0

    # Transitions.

    def admit(self, num_cached_tokens: int) -> None:
        """Runs from now on; the prefix cache served its first num_cached_tokens tokens."""
        self.status = SequenceStatus.RUNNING
        self.num_computed_tokens = self.num_cached_tokens = num_cached_tokens
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    def schedule(self, num_tokens: int) -> ScheduledSequence:
        """The next step computes num_tokens more tokens (n decode iterations count n); what it
        samples is pending until its reply. Returns what the worker must be sent for it."""
        start, total = self.num_computed_tokens, self.num_scheduled_tokens_total
        self.num_computed_tokens += num_tokens
        num_samples = num_sampled_tokens(total, self.num_computed_tokens)
        self.num_pending_tokens += num_samples
        token_ids = [] if self.worker_holds_last_token else self.token_ids[start:start + num_tokens]
        scheduled = ScheduledSequence(self, num_tokens, start, not self.is_on_worker, num_samples, token_ids,
                                      self.block_table[max(self.num_blocks_on_worker, 0):])
        self.num_blocks_on_worker = len(self.block_table)
        self.worker_holds_last_token = num_samples > 0
        return scheduled

    def append_tokens(self, token_ids: list[int]) -> None:
        """Tokens sampled by a step in flight arrived (several: a step of several decode iterations)."""
        self.num_pending_tokens -= len(token_ids)
        self.token_ids.extend(token_ids)

    def preempt(self) -> None:
        """Back to waiting, to be recomputed from its tokens (its blocks are freed first). Tokens of
        steps still in flight will be dropped: the preemption count tells them apart."""
        self._forget_computed()
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def finish(self, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        """Ends the sequence (its blocks are freed first)."""
        self._forget_computed()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.matched_stop = matched_stop

    def _forget_computed(self) -> None:
        """The one reset: nothing computed, pending or held by a worker survives."""
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_blocks_on_worker = -1
        self.worker_holds_last_token = False


class ScheduledSequence(NamedTuple):
    """What one step does for one sequence, and what the worker must be sent for it. A named tuple:
    one is made per sequence per step, and a frozen dataclass costs several times more to build."""

    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at start_position
    start_position: int
    is_new_on_worker: bool
    num_samples: int  # tokens the step samples for it: 0 mid-prompt, 1, or num_decode_steps
    # The tokens to send: none for a decode, whose token the worker sampled itself (with lookahead
    # the scheduler may not even know it yet).
    token_ids: list[int]
    new_block_ids: list[int]  # blocks the worker has not seen: all of them for a new sequence
