"""A request's state as the scheduler owns it: token ids, block table and counters."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from common.sampling_params import SamplingParams


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
    computed (a prompt or its rest, or the last sampled token during decode).
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
    # time.monotonic() when queued, and when first admitted to a step (for the queue-time metric).
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None

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
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_scheduled_tokens_total - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_on_worker(self) -> bool:
        return self.num_blocks_on_worker >= 0

    def reset_for_recompute(self) -> None:
        """Forgets everything cache-related: the sequence is recomputed from its tokens. Tokens of
        steps still in flight will be dropped (the preemption count changes)."""
        self.status = SequenceStatus.WAITING
        self.block_table = []
        self.block_hashes = []
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_blocks_on_worker = -1
        self.worker_holds_last_token = False
        self.num_preemptions += 1
