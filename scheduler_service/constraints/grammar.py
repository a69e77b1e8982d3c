"""One constraint compiled for one vocabulary: the llguidance tokenizer of the model, the grammar
text of each kind of constraint, and the compiled matcher that every sequence under it copies.

Compiling runs on the calling thread and can take milliseconds (llguidance drops the GIL meanwhile):
the compiler (compiler.py) calls it from its thread pool, under its time limit.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import llguidance
import numpy as np

from common.contract.constraint import Constraint
from common.contract.grammar_tokenizer import GrammarTokenizer, fill_bitmask, new_matcher
from scheduler_service.constraints.token_mask import EncodedMasks, num_allowed
from scheduler_service.core.errors import RequestError

# Compact JSON: no whitespace anywhere, so that a model cannot spend its tokens on blanks.
JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}
MAX_REASON_CHARS = 1000  # the library's reason, as the client sees it (it can quote the grammar)


@dataclass(frozen=True)
class Vocabulary:
    """What a grammar is compiled against: the model's tokens as llguidance sees them (spec, built into
    tokenizer), padded to the worker's vocab_size (the ids past the tokenizer's are never allowed), and
    its EOS ids (allowed once the grammar accepts what was generated). The worker builds the same from
    spec when it advances grammars itself."""

    spec: GrammarTokenizer
    tokenizer: llguidance.LLTokenizer

    @property
    def vocab_size(self) -> int:
        """The worker's: the width of every mask."""
        return self.spec.vocab_size

    @property
    def num_text_tokens(self) -> int:
        """The tokenizer's, within vocab_size: ids from here to vocab_size are padding."""
        return self.spec.first_padding_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.spec.eos_token_ids

    @property
    def padded_eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids past the tokenizer's tokens, which llguidance cannot take: fill_mask allows them itself."""
        return self.spec.padded_eos_token_ids


def build_vocabulary(spec: GrammarTokenizer) -> Vocabulary:
    """The llguidance tokenizer of a Hugging Face tokenizer.json text (about 0.2 s for 49k tokens, so
    built once per model). Raises RequestError when llguidance cannot read the tokenizer."""
    try:
        tokenizer = spec.build()
    except (ValueError, RuntimeError) as exc:
        raise RequestError(f"constraint: the grammar library cannot use this model's tokenizer ({exc})") from exc
    return Vocabulary(spec, tokenizer)


@dataclass(frozen=True)
class Grammar:
    """A constraint compiled for one vocabulary. Its matcher never consumes a token: each sequence
    under the constraint starts from a copy (constraints/state.py). text: the grammar the matcher was
    built from, which a worker that advances grammars itself builds its own matcher from."""

    constraint: Constraint
    vocabulary: Vocabulary
    matcher: llguidance.LLMatcher
    text: str
    masks: EncodedMasks = field(default_factory=EncodedMasks, compare=False)  # shared by its sequences


def field_of(constraint: Constraint) -> str:
    """The public field that an error about this constraint names."""
    return "constraint.choice.choices" if constraint.kind == "choice" else f"constraint.{constraint.kind}"


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint (not checked yet: compiling checks it)."""
    kind, value = constraint.kind, constraint.value
    if kind == "json_schema":
        schema = json.loads(value)  # type: ignore[arg-type]  # valid JSON: Constraint checked it
        if isinstance(schema, bool):  # `true` (anything) or `false` (nothing), which options cannot attach to
            schema = {"allOf": [schema]}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)  # type: ignore[arg-type]
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)  # type: ignore[arg-type]
    # Choices as Lark string literals, which read JSON's escapes: quotes, backslashes, newlines and
    # control characters in a choice stand for themselves.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))


def compile_grammar(constraint: Constraint, vocabulary: Vocabulary) -> Grammar:
    """Compiles the constraint and checks that the vocabulary can satisfy it; raises RequestError
    naming the public field, with the library's reason."""
    field = field_of(constraint)
    try:
        text = grammar_text(constraint)
    except ValueError as exc:
        raise RequestError(f"{field}: {_reason(str(exc))}") from exc
    matcher = new_matcher(vocabulary.tokenizer, text)
    if matcher.is_error():
        raise RequestError(f"{field}: {_reason(matcher.get_error())}")
    check_first_mask(field, first_mask(matcher, vocabulary), vocabulary)
    return Grammar(constraint, vocabulary, matcher, text)


def fill_mask(matcher: llguidance.LLMatcher, vocabulary: Vocabulary, bitmask: np.ndarray) -> None:
    """Writes the tokens matcher allows next into bitmask (int32 words; padding ids forbidden)."""
    fill_bitmask(matcher, vocabulary.spec, bitmask)


def first_mask(matcher: llguidance.LLMatcher, vocabulary: Vocabulary) -> np.ndarray:
    bitmask = np.zeros(vocabulary.spec.num_bitmask_words, dtype=np.int32)
    fill_mask(matcher, vocabulary, bitmask)
    return bitmask


def check_first_mask(field: str, bitmask: np.ndarray, vocabulary: Vocabulary) -> None:
    """A constraint must let an output begin: some token allowed, and not only EOS (the empty output)."""
    allowed = num_allowed(bitmask)
    if allowed == 0:
        raise RequestError(f"{field}: no token of this model's vocabulary can begin an output it allows")
    eos_allowed = sum(1 for t in vocabulary.eos_token_ids
                      if t < vocabulary.vocab_size and bitmask[t // 32] >> (t % 32) & 1)
    if allowed == eos_allowed:
        raise RequestError(f"{field}: allows only the empty output")


def _reason(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."
