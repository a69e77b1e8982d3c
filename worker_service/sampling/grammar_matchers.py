"""Grammars the worker advances itself (structured output with --grammar-masks worker): the session's
grammar tokenizer, built at InitCache from what the scheduler built its own from
(common/contract/grammar_tokenizer.py), a matcher per constrained sequence, and each step's masks in
the packed form the scheduler's TokenMasks decode to (token_masks.py), so that every sampling path
applies them alike.

A sequence's matcher consumes every token sampled for it exactly once, in order, where the worker
records its samples (runtime/sequence_state.py record_sampled); the scheduler's own matcher, fed with
the same tokens, decides the request's fate. llguidance is imported only here, and only once a session
sends a grammar tokenizer.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from common.contract.grammar_tokenizer import GrammarTokenizer, allow, finish_bitmask, new_matcher
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.sampling.token_masks import num_mask_bytes

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 64  # compiled grammars kept (a JSON schema: milliseconds to compile, ~100 KB)
# Rows from which masks are computed on llguidance's threads (a mask takes ~10-100 µs for 49k tokens);
# fewer are computed on this thread, without the handoff.
MIN_PARALLEL_ROWS = 4


class WorkerGrammars:
    """The session's grammar tokenizer and the grammars compiled for it: one matcher per distinct grammar
    text, compiled once (the costly part) and copied for each sequence, the least recently used dropped
    past MAX_CACHED_GRAMMARS."""

    def __init__(self, spec: GrammarTokenizer, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        """Builds the tokenizer (about 0.2 s for 49k tokens); ValueError or RuntimeError when llguidance
        cannot read it."""
        self.spec = spec
        self.tokenizer = spec.build()
        self.max_cached = max_cached
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None

    @classmethod
    def of(cls, message: worker_pb2.GrammarTokenizer) -> WorkerGrammars:
        """The grammars of a session's InitCache; ValueError naming the field when the library refuses it."""
        try:
            return cls(GrammarTokenizer.from_proto(message))
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"grammar_tokenizer: the grammar library cannot use it ({error})") from None

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled matcher of grammar (never consumes a token), from the cache or compiled now;
        ValueError with the library's reason for a grammar it refuses."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = new_matcher(self.tokenizer, grammar)
            if compiled.is_error():
                raise ValueError(f"grammar: the grammar library refused it ({compiled.get_error()[:200]})")
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.max_cached:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled

    def start(self, seq_id: int, message: worker_pb2.Grammar) -> SequenceGrammar:
        """A new sequence's matcher, past the output tokens it holds already (ValueError naming the field
        for a refused grammar or an id outside the vocabulary)."""
        output_token_ids = list(message.output_token_ids)
        if any(not 0 <= t < self.spec.vocab_size for t in output_token_ids):
            bad = next(t for t in output_token_ids if not 0 <= t < self.spec.vocab_size)
            raise ValueError(f"grammar.output_token_ids: ids must be in [0, {self.spec.vocab_size}), got {bad}")
        grammar = SequenceGrammar(seq_id, self.compile(message.grammar).deep_copy(), self.spec)
        grammar.consume(output_token_ids)
        return grammar

    def fill_masks(self, grammars: Sequence[SequenceGrammar]) -> list[np.ndarray | None]:
        """Each sequence's allowed next tokens as packed bits ([num_mask_bytes(vocab_size)] uint8, bits
        past the vocabulary clear), in order; None for a row left unmasked (a failed grammar with no EOS
        to allow, whose request the scheduler fails)."""
        spec = self.spec
        bitmask = np.zeros((len(grammars), spec.num_bitmask_words), dtype=np.int32)
        live = [(g.matcher, row) for row, g in enumerate(grammars) if not g.is_ended]
        if len(live) >= MIN_PARALLEL_ROWS:
            import llguidance.numpy

            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, bitmask)
        else:
            for matcher, row in live:
                matcher.unsafe_compute_mask_ptr(bitmask[row].ctypes.data, bitmask[row].nbytes)
        eos_ids = sorted(t for t in spec.eos_token_ids if t < spec.vocab_size)
        for row, grammar in enumerate(grammars):
            if grammar.is_ended:
                allow(bitmask[row], eos_ids)
            else:
                finish_bitmask(grammar.matcher, spec, bitmask[row])
        for row in np.flatnonzero(~bitmask.any(axis=1)):  # a matcher in error whose tokenizer has no EOS of its own
            allow(bitmask[row], eos_ids)
        # Byte t // 8, bit t % 8: llguidance's words in little-endian byte order, cut to the vocabulary.
        vocab_size = spec.vocab_size
        packed = bitmask.astype("<i4", copy=False).view(np.uint8)[:, :num_mask_bytes(vocab_size)]
        if vocab_size % 8:
            packed[:, -1] &= (1 << vocab_size % 8) - 1
        masks: list[np.ndarray | None] = list(packed)
        if not eos_ids:  # nothing to allow such a row: it goes unmasked
            for row in np.flatnonzero(~packed.any(axis=1)):
                masks[row] = None
        return masks


class SequenceGrammar:
    """One sequence's matcher on the worker: it has consumed every token sampled for the sequence so far."""

    __slots__ = ("seq_id", "matcher", "spec", "is_ended", "has_failed", "num_taken_early")

    def __init__(self, seq_id: int, matcher: llguidance.LLMatcher, spec: GrammarTokenizer) -> None:
        self.seq_id = seq_id
        self.matcher = matcher
        self.spec = spec
        # An EOS past the tokenizer's tokens ended the output (llguidance does not know the id): EOS alone next.
        self.is_ended = False
        self.has_failed = False  # a token was refused: the matcher is in error, its masks EOS alone
        # Tokens of the step being run that a later iteration of it consumed already (take_early).
        self.num_taken_early = 0

    def take_early(self, token_id: int) -> None:
        """A token an iteration of a multi-iteration step sampled, read back for the next iteration's
        mask before the step's tokens are recorded."""
        self.consume([token_id])
        self.num_taken_early += 1

    def consume_recorded(self, token_ids: list[int]) -> None:
        """A step's tokens as the worker records them: those not taken early."""
        taken, self.num_taken_early = self.num_taken_early, 0
        self.consume(token_ids[taken:])

    def consume(self, token_ids: Iterable[int]) -> None:
        """Advances past the sequence's next tokens, in order. A token the grammar refuses cannot be
        sampled under its mask: it is logged once and the matcher left in error (the scheduler's matcher
        refuses it too, and fails the request). A completed grammar takes EOS, which a step launched
        before the scheduler saw the completion samples (its token is dropped)."""
        matcher, padded_eos = self.matcher, self.spec.padded_eos_token_ids
        for token_id in token_ids:
            if self.is_ended or self.has_failed:
                return
            if padded_eos and token_id in padded_eos and matcher.is_accepting():
                self.is_ended = True
            elif not matcher.consume_token(token_id):
                self.has_failed = True
                logger.error("sequence %d: its grammar refuses the sampled token %d (%s); its later masks allow "
                             "EOS alone", self.seq_id, token_id, matcher.get_error()[:200])

