"""What a worker remembers of a sequence between steps: no more than the next step needs. Only
WorkerSequence's methods change it (tests/worker_service/test_worker_sequence_ownership.py)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from common.contract.lookahead import num_sampled_tokens
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.sampling.grammar_matchers import SequenceGrammar, WorkerGrammars
from worker_service.sampling.logit_edits import TokenBias


class LaunchedStep(Protocol):
    """A launched step whose sampled tokens may still be on the device (worker.PendingStep)."""

    device_token_ids: torch.Tensor | None  # [num_sampling_rows]: each row's last sampled token

    def result(self) -> worker_pb2.StepResponse:
        """Waits for the step's tokens (and those of every step launched before it)."""
        ...


class PendingToken(NamedTuple):
    """A token sampled by a step not read back yet: row `row` of that step's device output."""

    step: LaunchedStep
    row: int


@dataclass
class WorkerSequence:
    seq_id: int
    block_table: list[int]
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_tokens: int  # tokens the sequence holds, as far as this worker knows
    num_prompt_tokens: int
    sampling: SamplingParams
    last_token: int | None = None  # sampled by this worker, not computed yet
    # While the step that sampled the last token has not been read back: the next decode step takes
    # the token from that step's device tensor, without waiting for it.
    pending: PendingToken | None = None
    # Every token of the sequence, kept only when a penalty needs the history.
    token_ids: list[int] | None = None
    logit_bias: TokenBias | None = None  # sampling.logit_bias as arrays
    min_tokens_banned_ids: tuple[int, ...] = ()  # what sampling.min_tokens holds back
    # With prompt logprobs, between two chunks of the prompt: the logits ([1, vocab_size], on the
    # device) of the last position computed, which score the first token of the next chunk.
    prompt_logits_tail: torch.Tensor | None = None
    # Structured output advanced by the worker (NewSequence.grammar): the matcher that has consumed every
    # output token of the sequence known here, whose mask each sample takes (None: no grammar here).
    grammar: SequenceGrammar | None = None

    @classmethod
    def from_message(cls, message: worker_pb2.NewSequence, vocab_size: int,
                     grammars: WorkerGrammars | None = None) -> WorkerSequence:
        """The state of a sequence new to this worker; ValueError for token ids outside the vocabulary, or
        a grammar the session cannot take (no grammar tokenizer, a token mask as well, refused)."""
        sampling = SamplingParams.from_proto(message.sampling)
        try:
            logit_bias = TokenBias.of(sampling.logit_bias, vocab_size)
        except ValueError as error:
            raise ValueError(f"sequence {message.seq_id}: sampling.{error}") from None
        banned = tuple(message.sampling.min_tokens_banned_ids)
        if any(not 0 <= token < vocab_size for token in banned):
            raise ValueError(f"sequence {message.seq_id}: sampling.min_tokens_banned_ids: token ids must be in "
                             f"[0, {vocab_size}), got {next(t for t in banned if not 0 <= t < vocab_size)}")
        history = None
        if sampling.needs_token_history:
            history = list(message.cached_token_ids)
            if len(history) != message.num_computed_tokens:
                raise ValueError(f"sequence {message.seq_id}: a penalty needs cached_token_ids for all "
                                 f"{message.num_computed_tokens} cached tokens, got {len(history)}")
        return cls(seq_id=message.seq_id, block_table=list(message.block_table),
                   num_computed_tokens=message.num_computed_tokens, num_tokens=message.num_tokens,
                   num_prompt_tokens=message.num_prompt_tokens, sampling=sampling, token_ids=history,
                   logit_bias=logit_bias, min_tokens_banned_ids=banned, grammar=_grammar_of(message, grammars))

    def add_blocks(self, block_ids: Iterable[int]) -> None:
        self.block_table.extend(block_ids)

    def take_chunk(self, token_ids: list[int], can_grow: bool = False) -> bool:
        """Takes tokens the scheduler sent to compute next (not one the worker sampled); returns whether
        they reach the end of the sequence (and so sample). can_grow: they may end past the known end."""
        if not token_ids:
            raise ValueError(f"sequence {self.seq_id}: empty chunk")
        end = self.num_computed_tokens + len(token_ids)
        if can_grow:
            self.num_tokens = max(self.num_tokens, end)
        if self.token_ids is not None:
            self.token_ids.extend(token_ids)
        return end >= self.num_tokens

    def advance(self, num_chunk_tokens: int, num_decode_steps: int, pending: PendingToken | None) -> None:
        """Counts a launched step that computes a chunk of num_chunk_tokens and then num_decode_steps - 1
        tokens it samples itself; pending: where its last sampled token will be (None: it samples none)."""
        self.num_computed_tokens += num_chunk_tokens + num_decode_steps - 1
        self.num_tokens += num_sampled_tokens(self.num_tokens, self.num_computed_tokens)
        self.last_token = None
        self.pending = pending

    def keep_prompt_logits(self, tail: torch.Tensor | None) -> None:
        """The logits that score the next prompt chunk's first token (None: no chunk of the prompt follows)."""
        self.prompt_logits_tail = tail

    def record_sampled(self, step: LaunchedStep, token_ids: list[int]) -> None:
        """The tokens step sampled for this sequence, read back: the last one is the next to compute,
        unless a later step has taken its place already."""
        if self.pending is not None and self.pending.step is step:
            self.pending = None
            self.last_token = token_ids[-1]
        if self.token_ids is not None:
            self.token_ids.extend(token_ids)
        if self.grammar is not None:  # where a sampled token reaches the matcher, unless it took it early
            self.grammar.consume_recorded(token_ids)


def _grammar_of(message: worker_pb2.NewSequence, grammars: WorkerGrammars | None) -> SequenceGrammar | None:
    """The matcher of a new sequence's grammar (None without one), past its output tokens."""
    if not message.HasField("grammar"):
        return None
    if grammars is None:
        raise ValueError(f"sequence {message.seq_id}: grammar: this session has no grammar tokenizer (its InitCache "
                         "sent none, or one the grammar library cannot read)")
    if message.HasField("token_mask"):
        raise ValueError(f"sequence {message.seq_id}: grammar: not allowed with a token_mask")
    try:
        return grammars.start(message.seq_id, message.grammar)
    except ValueError as error:
        raise ValueError(f"sequence {message.seq_id}: {error}") from None
