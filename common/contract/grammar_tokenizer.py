"""The grammar library's (llguidance's) view of the model's tokenizer, as the scheduler and the worker
both build it: the one place that says how a tokenizer and a vocabulary become an llguidance tokenizer,
a matcher, and a matcher's bitmask of allowed tokens, so that the scheduler's matcher of a sequence and
the worker's (structured output with the worker's masks) allow exactly the same tokens.

llguidance is imported on first use: a worker that never sees a grammar pays nothing for it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.generated.nanovllm.worker.v1 import worker_pb2

if TYPE_CHECKING:
    import llguidance


@dataclass(frozen=True)
class GrammarTokenizer:
    """A Hugging Face tokenizer.json and the vocabulary every mask spans: the model's vocab_size ids, of
    which the first num_text_tokens are the tokenizer's (the rest padding, never allowed), and the EOS
    ids (allowed once the grammar accepts what was generated; those past the tokenizer's tokens, which
    llguidance cannot take, are added to its masks here)."""

    tokenizer_json: str
    num_text_tokens: int  # the tokenizer's own tokens
    vocab_size: int  # the model's (the worker's): the width of every mask
    eos_token_ids: frozenset[int]

    @property
    def num_grammar_tokens(self) -> int:
        """llguidance's vocabulary (n_vocab): its bitmasks have a bit for each."""
        return max(self.vocab_size, self.num_text_tokens)

    @property
    def first_padding_id(self) -> int:
        """Ids from here on are no text: never allowed (but for padded EOS ids)."""
        return min(self.num_text_tokens, self.vocab_size)

    @property
    def text_eos_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(t for t in self.eos_token_ids if t < self.num_text_tokens))

    @property
    def padded_eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids past the tokenizer's tokens (a model's config may name one)."""
        return tuple(sorted(t for t in self.eos_token_ids if self.num_text_tokens <= t < self.vocab_size))

    @property
    def num_bitmask_words(self) -> int:
        """int32 words of one of llguidance's bitmasks."""
        return (self.num_grammar_tokens + 31) // 32

    def build(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (about 0.2 s for 49k tokens: once per model and session). Raises
        ValueError or RuntimeError when llguidance cannot read the tokenizer."""
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.num_grammar_tokens,
                                      eos_token=list(self.text_eos_token_ids) or None)

    def to_proto(self) -> worker_pb2.GrammarTokenizer:
        return worker_pb2.GrammarTokenizer(tokenizer_json=self.tokenizer_json, eos_token_ids=sorted(self.eos_token_ids),
                                           vocab_size=self.vocab_size, num_text_tokens=self.num_text_tokens)

    @classmethod
    def from_proto(cls, message: worker_pb2.GrammarTokenizer) -> GrammarTokenizer:
        return cls(message.tokenizer_json, message.num_text_tokens, message.vocab_size,
                   frozenset(message.eos_token_ids))


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher of grammar (llguidance's text form), compiled now (milliseconds for a JSON schema;
    llguidance drops the GIL meanwhile). Within llguidance's own bounds on the work one mask may take
    (lexer fuel ~14k/ms, Earley items ~20k/ms: about 15 ms at worst) and on the grammar's size, at the
    library's defaults; its errors leave out the parser's state and the grammar's text, which would
    fill a log with a 64 KB grammar per failure. Check is_error() for a grammar it refused."""
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(verbose_errors=False))


def fill_bitmask(matcher: llguidance.LLMatcher, spec: GrammarTokenizer, bitmask: np.ndarray) -> None:
    """Writes the tokens matcher allows next into bitmask (spec.num_bitmask_words int32 words, bit t of
    word t // 32; C-contiguous): llguidance's mask, then finish_bitmask."""
    matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    finish_bitmask(matcher, spec, bitmask)


def finish_bitmask(matcher: llguidance.LLMatcher, spec: GrammarTokenizer, bitmask: np.ndarray) -> None:
    """Completes llguidance's mask of matcher (in bitmask) for the model's vocabulary: padding ids
    forbidden, EOS ids past the tokenizer's allowed once the grammar accepts."""
    if matcher.is_error():  # a parser limit or a refused token: the mask is EOS alone, and consuming it fails
        return
    clear_past(bitmask, spec.first_padding_id)
    if spec.padded_eos_token_ids and matcher.is_accepting():
        allow(bitmask, spec.padded_eos_token_ids)


def allow(bitmask: np.ndarray, token_ids: Iterable[int]) -> None:
    """Sets the bits of token_ids (int32 words, bit t of word t // 32)."""
    for token_id in token_ids:
        bitmask[token_id // 32] |= np.int32(np.uint32(1 << token_id % 32).view(np.int32))


def clear_past(bitmask: np.ndarray, first_forbidden: int) -> None:
    """Forbids every token from first_forbidden on (bitmask: int32 words, bit t of word t // 32):
    the worker's vocabulary may be padded past the tokenizer's, and those ids are never text."""
    word, bit = divmod(first_forbidden, 32)
    if word >= bitmask.size:
        return
    if bit:
        bitmask[word] &= np.int32((1 << bit) - 1)  # bits below `bit` stay (bit < 32: a positive int32)
        word += 1
    bitmask[word:] = 0
