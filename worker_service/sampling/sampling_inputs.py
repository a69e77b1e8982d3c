"""The rows one step samples: each sequence's parameters and, where a penalty needs them, its tokens."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker_service.batch import ScheduledChunk


@dataclass(frozen=True)
class SamplingRows:
    """What SamplingBatch.build lays out. Row i samples output token number output_index[i] (0 for
    the first) of a sequence whose prompt and output so far are given; the token lists are read
    only for rows with a penalty (prompt tokens only for the repetition penalty)."""

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int] | None]  # None where the worker keeps no history
    output_token_ids: Sequence[Sequence[int]]
    output_index: Sequence[int]

    def __post_init__(self) -> None:
        if not len(self.prompt_token_ids) == len(self.output_token_ids) == len(self.output_index) == len(self.params):
            raise ValueError("params, prompt_token_ids, output_token_ids and output_index differ in length")

    @classmethod
    def of_chunks(cls, chunks: Sequence[ScheduledChunk]) -> SamplingRows:
        """The rows of the chunks that sample, in order."""
        states = [chunk.state for chunk in chunks]
        params = [state.sampling for state in states]
        indices = [state.num_tokens - state.num_prompt_tokens for state in states]
        if all(state.token_ids is None for state in states):  # no penalties: no token lists to slice
            return cls(params, [None] * len(states), [()] * len(states), indices)
        prompts: list[Sequence[int] | None] = []
        outputs: list[Sequence[int]] = []
        for state in states:
            history = state.token_ids
            prompts.append(None if history is None else history[:state.num_prompt_tokens])
            outputs.append([] if history is None else history[state.num_prompt_tokens:])
        return cls(params, prompts, outputs, indices)
