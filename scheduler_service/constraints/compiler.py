"""Compiles constraints off the event loop, within a time limit, once per distinct constraint.

A small thread pool runs llguidance (which drops the GIL), so the engine's loop never waits for a
grammar. A compilation past the limit fails its request with INVALID_ARGUMENT naming the limit; it
may go on in its thread (llguidance cannot be interrupted, but its own limits bound it), and its
result is dropped. Results, errors included, are kept in an LRU cache keyed by the constraint and
the vocabulary, and requests for a constraint being compiled wait for the same compilation.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from common.contract.constraint import Constraint
from common.contract.grammar_tokenizer import GrammarTokenizer
from common.contract.quoting import quote
from scheduler_service.constraints.grammar import Grammar, Vocabulary, build_vocabulary, compile_grammar, field_of
from scheduler_service.constraints.state import ConstraintState
from scheduler_service.core.errors import RequestError

logger = logging.getLogger(__name__)
NUM_COMPILE_THREADS = 2
MAX_CACHED_GRAMMARS = 128

VocabularyKey = tuple[int, frozenset[int]]  # the worker's vocab_size, the EOS ids


class TokenizerSource(Protocol):
    """What the compiler needs of the scheduler's tokenizer (api/tokenizer.py's Tokenizer)."""

    backend: object  # a tokenizers.Tokenizer: to_str() is its tokenizer.json

    @property
    def vocab_size(self) -> int: ...


class CompiledConstraint:
    """A grammar ready for sequences: new_state() gives each its own place in it."""

    __slots__ = ("grammar",)

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar

    def new_state(self) -> ConstraintState:
        return ConstraintState(self.grammar)

    def fits(self, vocab_size: int, eos_token_ids: Iterable[int]) -> bool:
        """Whether it was compiled for this vocabulary (a lane of another model needs its own)."""
        vocabulary = self.grammar.vocabulary
        return vocabulary.vocab_size == vocab_size and vocabulary.eos_token_ids == frozenset(eos_token_ids)


class ConstraintCompiler:
    """One per service (or offline LLM), for its tokenizer; close() stops its threads."""

    def __init__(self, tokenizer: TokenizerSource, max_compile_ms: int,
                 max_cached: int = MAX_CACHED_GRAMMARS, num_threads: int = NUM_COMPILE_THREADS,
                 compile_fn: Callable[[Constraint, Vocabulary], Grammar] = compile_grammar) -> None:
        self.tokenizer = tokenizer
        self.max_compile_ms = max_compile_ms
        self.max_cached = max_cached
        self._compile_fn = compile_fn  # tests slow it down
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self._vocabularies: dict[VocabularyKey, Future[Vocabulary]] = {}
        self._cache: OrderedDict[tuple[Constraint, VocabularyKey], Future[CompiledConstraint]] = OrderedDict()
        self._lock = threading.Lock()  # the offline LLM and the event loop may both compile
        self._tokenizer_json: str | None = None  # the tokenizer's tokenizer.json, read once
        self.num_compiled = 0  # compilations started (cache misses), for tests

    @property
    def is_supported(self) -> bool:
        """False once llguidance turned the tokenizer down (else True: it is tried on first use)."""
        with self._lock:
            futures = list(self._vocabularies.values())
        return not any(f.done() and f.exception() is not None for f in futures)

    def prepare(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        """Starts building the vocabulary in the background, so that the first constraint need not
        wait for it (a lane's worker connected)."""
        self._vocabulary((vocab_size, frozenset(eos_token_ids)))

    async def compile(self, constraint: Constraint, vocab_size: int,
                      eos_token_ids: Iterable[int]) -> CompiledConstraint:
        """The constraint compiled for the vocabulary, from the cache or the pool; raises RequestError
        for a malformed constraint, one the vocabulary cannot satisfy, or one past the time limit. The
        vocabulary's first build (once per model) does not count towards the limit."""
        key = (vocab_size, frozenset(eos_token_ids))
        try:
            vocabulary = self._vocabulary(key)
            if not vocabulary.done():
                await asyncio.wrap_future(vocabulary)
            future = self._compiled(constraint, key)
            if future.done():
                return future.result()
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.max_compile_ms / 1e3)
            except TimeoutError:
                self._drop(constraint, key, future)
                raise self._too_slow(constraint) from None
        except RequestError as error:
            raise _fresh(error) from None

    def compile_now(self, constraint: Constraint, vocab_size: int, eos_token_ids: Iterable[int]) -> CompiledConstraint:
        """compile() for a caller without an event loop (the offline LLM): waits on this thread."""
        key = (vocab_size, frozenset(eos_token_ids))
        try:
            self._vocabulary(key).result()
            future = self._compiled(constraint, key)
            try:
                return future.result(timeout=self.max_compile_ms / 1e3)
            except TimeoutError:
                self._drop(constraint, key, future)
                raise self._too_slow(constraint) from None
        except RequestError as error:
            raise _fresh(error) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _too_slow(self, constraint: Constraint) -> RequestError:
        return RequestError(f"{field_of(constraint)}: compiling it took longer than the limit of "
                            f"{self.max_compile_ms} ms (max_grammar_compile_ms); simplify it")

    def _vocabulary(self, key: VocabularyKey) -> Future[Vocabulary]:
        with self._lock:
            future = self._vocabularies.get(key)
            if future is None:
                future = self._vocabularies[key] = self._pool.submit(self._build_vocabulary, key)
            return future

    def grammar_tokenizer(self, vocab_size: int, eos_token_ids: Iterable[int]) -> GrammarTokenizer | None:
        """What the grammars of this vocabulary are compiled against, for a worker that advances them
        itself (it builds the same llguidance tokenizer from it); None when the tokenizer is not a Hugging
        Face one (then no constraint compiles). Reads the tokenizer's JSON the first time (tens of ms
        for a large vocabulary: call it off the event loop)."""
        try:
            return self._spec((vocab_size, frozenset(eos_token_ids)))
        except RequestError:
            return None

    def _spec(self, key: VocabularyKey) -> GrammarTokenizer:
        with self._lock:
            if self._tokenizer_json is None:
                try:
                    self._tokenizer_json = self.tokenizer.backend.to_str()  # type: ignore[attr-defined]
                except AttributeError:
                    raise RequestError("constraint: the grammar library needs a Hugging Face tokenizer") from None
            return GrammarTokenizer(self._tokenizer_json, self.tokenizer.vocab_size, *key)

    def _build_vocabulary(self, key: VocabularyKey) -> Vocabulary:
        # Holds the GIL throughout (about 0.2 s for 49k tokens): once per model, when its first
        # worker connects (prepare) or at the first constraint.
        return build_vocabulary(self._spec(key))

    def _compiled(self, constraint: Constraint, key: VocabularyKey) -> Future[CompiledConstraint]:
        """The cached compilation of constraint (done, or under way), else a new one in the pool."""
        cache_key = (constraint, key)
        with self._lock:
            future = self._cache.get(cache_key)
            if future is not None:
                self._cache.move_to_end(cache_key)
                return future
            vocabulary = self._vocabularies[key].result()  # done: raises its RequestError if it failed
            future = self._pool.submit(self._compile_one, constraint, vocabulary)
            self._cache[cache_key] = future
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def _compile_one(self, constraint: Constraint, vocabulary: Vocabulary) -> CompiledConstraint:
        try:
            return CompiledConstraint(self._compile_fn(constraint, vocabulary))
        except RequestError:
            raise
        except Exception as exc:  # the library failing on this input: the request's problem, not the service's
            logger.exception("compiling a %s constraint failed", constraint.kind)
            raise RequestError(f"{field_of(constraint)}: the grammar library failed on it ({quote(str(exc))})") from exc

    def _drop(self, constraint: Constraint, key: VocabularyKey, future: Future[CompiledConstraint]) -> None:
        """Forgets a compilation past its time limit. It is not cancelled: another request may be
        waiting for it within its own limit."""
        with self._lock:
            if self._cache.get((constraint, key)) is future:
                del self._cache[(constraint, key)]


def _fresh(error: RequestError) -> RequestError:
    """A new error with the cached one's message: raising the cached instance for every request
    would grow its traceback (and the frames it keeps) with each."""
    return RequestError(str(error))
