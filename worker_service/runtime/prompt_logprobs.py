"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, and the
most likely alternatives, for the sequences that ask (SamplingParams.num_prompt_logprobs).

The token at position p (p >= 1) is scored by the logits at p - 1. A prefill chunk [s, e) scores
the prompt tokens at s..min(e, P) - 1 (P: the number of prompt tokens; position 0 never): position
s by the logits of the previous chunk's last position, which the worker keeps on the device between
the two chunks (WorkerSequence.prompt_logits_tail), the others by the chunk's own logits. So each
chunk's reply holds exactly its own tokens, and nothing waits for the next chunk. A chunk that
starts at s > 0 with no logits kept (a prefix-cache hit) starts at s + 1.

Memory stays bounded: logits and their float32 log_softmax are computed for the scored sequences'
rows alone, PROMPT_LOGITS_ROWS rows at a time; under tensor parallelism each block is gathered over
the vocabulary (a collective every rank runs, from the same step). Everything is queued on the
device; nothing waits for it.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.runtime.batch import ScheduledChunk
from worker_service.runtime.sequence_state import WorkerSequence
from worker_service.sampling.host_copies import host_to_device

PROMPT_LOGITS_ROWS = 256  # at Qwen3's 151,936 tokens: ~78 MB of bf16 logits, ~156 MB of float32 logprobs

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]  # hidden [n, H] -> logits [n, vocab_size], whole rows


@dataclass(frozen=True)
class ChunkScores:
    """Where one chunk's scores are in PromptScores' tensors: rows row.. of them, one per token."""

    state: WorkerSequence
    first_position: int
    token_ids: list[int]  # the prompt tokens at first_position, first_position + 1, ...
    row: int


@dataclass(frozen=True)
class PromptScores:
    """One step's prompt logprobs. top_*: max_num_top columns, by decreasing logprob (a chunk that
    asked for fewer uses a prefix); None when no chunk asked for alternatives."""

    chunks: list[ChunkScores]
    logprobs: torch.Tensor  # [T] float32
    top_token_ids: torch.Tensor | None  # [T, K] int64
    top_logprobs: torch.Tensor | None  # [T, K] float32
    # Per scored sequence, the logits its next chunk starts from (None: its prompt is done).
    tails: list[tuple[WorkerSequence, torch.Tensor | None]]

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> PromptScores:
        """The scores with function applied to the tensors of the reply (not to the tails)."""
        tops = [None if t is None else function(t) for t in (self.top_token_ids, self.top_logprobs)]
        return PromptScores(self.chunks, function(self.logprobs), tops[0], tops[1], self.tails)


def score_prompts(compute_logits: ComputeLogits, hidden: torch.Tensor,
                  prompt_chunks: list[tuple[int, ScheduledChunk]]) -> PromptScores:
    """The prompt logprobs of prompt_chunks (ModelInput.prompt_chunks) from the step's hidden states
    ([num_tokens, H]); compute_logits gives whole rows (gathered under tensor parallelism)."""
    max_num_top = max(chunk.state.sampling.num_prompt_logprobs for _, chunk in prompt_chunks)
    plans = [_plan(index, chunk) for index, chunk in prompt_chunks]
    all_targets = list(itertools.chain.from_iterable(plan.token_ids for plan in plans))
    targets = host_to_device(torch.tensor(all_targets, dtype=torch.int64), hidden.device)
    parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    chunks: list[ChunkScores] = []
    tails: list[tuple[WorkerSequence, torch.Tensor | None]] = []
    row = 0
    for plan in plans:
        chunks.append(ChunkScores(plan.state, plan.first_position, plan.token_ids, row))
        tail = None
        for block, is_last in _logits_blocks(compute_logits, hidden, plan):
            if plan.keeps_tail and is_last:
                block, tail = block[:-1], block[-1:].clone()  # a copy: the block itself is not kept
            if block.shape[0]:
                parts.append(_score(block, targets[row:row + block.shape[0]], max_num_top))
                row += block.shape[0]
        tails.append((plan.state, tail))
    if not parts:
        return PromptScores(chunks, torch.empty(0, dtype=torch.float32, device=hidden.device), None, None, tails)
    logprobs, top_ids, top_values = (None if column[0] is None else torch.cat(column)
                                     for column in zip(*parts, strict=True))
    return PromptScores(chunks, logprobs, top_ids, top_values, tails)


@dataclass(frozen=True)
class _ChunkPlan:
    state: WorkerSequence
    first_position: int
    token_ids: list[int]  # the prompt tokens scored, from first_position on
    first_row: int  # the input index of the chunk's first token
    num_rows: int  # of the chunk's own positions whose logits score a token here or in the next chunk
    tail: torch.Tensor | None  # the previous chunk's last logits: they score the chunk's first token
    keeps_tail: bool  # the prompt goes on after the chunk: its last row's logits are kept


def _plan(first_row: int, chunk: ScheduledChunk) -> _ChunkPlan:
    state = chunk.state
    start, num_prompt = state.num_computed_tokens, state.num_prompt_tokens
    end = start + len(chunk.token_ids)
    stop = min(end, num_prompt)
    tail = state.prompt_logits_tail if start > 0 else None
    first = start if tail is not None else start + 1
    keeps_tail = end < num_prompt
    # The last prompt position's logits score the first output token: the sampler's business.
    num_rows = stop - start - (0 if keeps_tail else 1)
    return _ChunkPlan(state, first, chunk.token_ids[first - start:stop - start], first_row, num_rows, tail,
                      keeps_tail)


def _logits_blocks(compute_logits: ComputeLogits, hidden: torch.Tensor,
                   plan: _ChunkPlan) -> Iterator[tuple[torch.Tensor, bool]]:
    """The logits that score the chunk's tokens, in order and in blocks, each with whether it is the
    last: the kept tail (if any), then the chunk's own rows, PROMPT_LOGITS_ROWS at a time."""
    if plan.tail is not None:
        yield plan.tail, plan.num_rows == 0
    for begin in range(0, plan.num_rows, PROMPT_LOGITS_ROWS):
        end = min(begin + PROMPT_LOGITS_ROWS, plan.num_rows)
        yield compute_logits(hidden[plan.first_row + begin:plan.first_row + end]), end == plan.num_rows


def _score(logits: torch.Tensor, targets: torch.Tensor,
           num_top: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each row's logprob of its target, and its top num_top (ids, logprobs); float32 throughout."""
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
    if num_top == 0:
        return chosen, None, None
    top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    return chosen, top.indices, top.values


def record_prompt_logprobs(scores: PromptScores, response: worker_pb2.StepResponse) -> None:
    """One PromptLogprobs per chunk that scored a token, from scores on the host."""
    logprobs = scores.logprobs.tolist()
    top_ids = scores.top_token_ids.tolist() if scores.top_token_ids is not None else None
    top_values = scores.top_logprobs.tolist() if scores.top_logprobs is not None else None
    for chunk in scores.chunks:
        if not chunk.token_ids:
            continue
        entry = response.prompt_logprobs.add(seq_id=chunk.state.seq_id, first_position=chunk.first_position)
        num_top = chunk.state.sampling.num_prompt_logprobs
        for row, token_id in enumerate(chunk.token_ids, start=chunk.row):
            scored = entry.tokens.add(token_id=token_id, logprob=logprobs[row])
            if num_top and top_ids is not None and top_values is not None:
                for token, value in zip(top_ids[row][:num_top], top_values[row][:num_top], strict=True):
                    scored.top_logprobs.add(token_id=token, logprob=value)
