"""A sequence's place in its grammar: what the scheduler's core holds in Sequence.constraint_state
(the TokenConstraint of core/sequence.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import llguidance
import numpy as np

from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.constraints.grammar import Grammar, fill_mask

if TYPE_CHECKING:
    from scheduler_service.core.sequence import Sequence


class ConstraintState:
    """An llguidance matcher that has consumed exactly the output tokens its sequence holds: tokens of
    steps in flight are not consumed before they are appended, so a sequence preempted or recomputed
    after a lost worker goes on from the same state. One made for a sequence that already holds output
    tokens (rebuilt) consumes them first, whenever it is next used."""

    __slots__ = ("grammar", "num_consumed", "_matcher")

    def __init__(self, grammar: Grammar, matcher: llguidance.LLMatcher | None = None, num_consumed: int = 0) -> None:
        self.grammar = grammar
        self.num_consumed = num_consumed  # output tokens the matcher has consumed
        self._matcher = matcher if matcher is not None else grammar.matcher.deep_copy()

    @property
    def error(self) -> str:
        """Why the last token was refused ("" when none was)."""
        return self._matcher.get_error()

    @property
    def grammar_text(self) -> str:
        """The grammar its matcher was built from (for a worker that advances the grammar itself)."""
        return self.grammar.text

    @property
    def is_complete(self) -> bool:
        """The grammar allows nothing more (but EOS)."""
        return self._matcher.is_stopped()

    def fork(self) -> ConstraintState:
        """A copy at the same place, that goes on alone (a parallel sample)."""
        return ConstraintState(self.grammar, self._matcher.deep_copy(), self.num_consumed)

    def consume(self, seq: Sequence, token_ids: list[int]) -> tuple[int, bool]:
        """Consumes token_ids, seq's new output tokens, up to the first that completes the grammar.
        Returns (how many it consumed, whether the grammar is complete); fewer than all and not complete:
        the next one is forbidden (see error)."""
        if not self._catch_up(seq):
            return 0, False
        matcher = self._matcher
        padded_eos = self.grammar.vocabulary.padded_eos_token_ids
        for index, token_id in enumerate(token_ids):
            if padded_eos and token_id in padded_eos and matcher.is_accepting():
                return index + 1, True  # an EOS llguidance does not know (not consumed): the output ends
            if not matcher.consume_token(token_id):
                return index, False
            self.num_consumed += 1
            if matcher.is_stopped():
                return index + 1, True
        return len(token_ids), False

    def write_mask(self, seq: Sequence, mask: worker_pb2.TokenMask) -> None:
        """Sets mask to the tokens seq may sample next (EOS among them only once the grammar is complete
        or accepts what was generated)."""
        self._catch_up(seq)  # a refused token leaves the matcher in error: EOS alone, refused in turn
        grammar = self.grammar
        vocabulary = grammar.vocabulary
        bitmask = np.zeros(vocabulary.spec.num_bitmask_words, dtype=np.int32)
        fill_mask(self._matcher, vocabulary, bitmask)
        grammar.masks.write(bitmask, vocabulary.vocab_size, mask)

    def _catch_up(self, seq: Sequence) -> bool:
        """Brings the matcher to seq's output tokens (a no-op but for a rebuilt sequence); False when
        the grammar refuses one of them."""
        num_outputs = seq.num_tokens - seq.num_prompt_tokens
        if self.num_consumed == num_outputs:
            return True
        if self.num_consumed > num_outputs:  # never in the engine: tokens are consumed once appended
            self._matcher.rollback(self.num_consumed - num_outputs)
            self.num_consumed = num_outputs
            return not self._matcher.is_error()
        missing = seq.token_ids[seq.num_prompt_tokens + self.num_consumed:]
        if not self._matcher.consume_tokens(missing):
            return False
        self.num_consumed = num_outputs
        return True
