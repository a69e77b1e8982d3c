"""The log-probabilities of one sequence's prompt tokens (GenerateRequest.prompt_logprobs), gathered
from the worker's replies chunk by chunk and handed out once, with the sequence's first output."""
from __future__ import annotations

from common.generated.nanovllm.worker.v1 import worker_pb2

# (token id, its logprob, the most likely alternatives as (token id, logprob)), one per prompt
# token after the first.
TokenScore = tuple[int, float, list[tuple[int, float]]]


class PromptLogprobs:
    """Positions 1..num_prompt_tokens-1; a position scored twice (a recompute after preemption or a
    worker's loss) keeps its first score."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self._scores: list[TokenScore | None] = [None] * max(num_prompt_tokens - 1, 0)
        self._num_missing = len(self._scores)
        self.is_delivered = False

    def add(self, message: worker_pb2.PromptLogprobs) -> None:
        for offset, scored in enumerate(message.tokens):
            index = message.first_position + offset - 1
            if 0 <= index < len(self._scores) and self._scores[index] is None:
                tops = [(top.token_id, top.logprob) for top in scored.top_logprobs]
                self._scores[index] = (scored.token_id, scored.logprob, tops)
                self._num_missing -= 1

    @property
    def is_complete(self) -> bool:
        return self._num_missing == 0

    def take(self) -> list[TokenScore] | None:
        """Every score, once all arrived and only the first time; else None."""
        if self.is_delivered or not self.is_complete:
            return None
        self.is_delivered = True
        return self._scores  # type: ignore[return-value]  # complete: no None left
