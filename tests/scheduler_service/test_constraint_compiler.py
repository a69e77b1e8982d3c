"""Constraints compiled with llguidance (scheduler_service/constraints/): malformed ones refused with
the public field and the library's reason, the time limit, the cache, choices escaped, compact JSON,
and the TokenMask encoding decoded back equal to llguidance's own mask."""
from __future__ import annotations

import asyncio
import json
import time

import llguidance
import numpy as np
import pytest

from common.contract.constraint import Constraint
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.api.tokenizer import Tokenizer
from scheduler_service.constraints import ConstraintCompiler, allowed_token_ids, write_token_mask
from scheduler_service.constraints.grammar import Grammar, Vocabulary, compile_grammar
from scheduler_service.core.errors import RequestError
from scheduler_service.core.sequence import Sequence
from tests.scheduler_service.constraint_helpers import VOCAB_SIZE, tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture
def compiler(tokenizer: Tokenizer):
    compiler = ConstraintCompiler(tokenizer, max_compile_ms=2000)
    yield compiler
    compiler.close()


def compile_now(compiler: ConstraintCompiler, constraint: Constraint):
    return compiler.compile_now(constraint, VOCAB_SIZE, {compiler.tokenizer.eos_token_id})


def output_of(tokenizer: Tokenizer, text: str) -> Sequence:
    """A sequence whose output is text (prompt: one token)."""
    return Sequence([1, *tokenizer.encode(text, add_special_tokens=False)], None, num_prompt_tokens=1)


def consume_text(state, tokenizer: Tokenizer, text: str) -> tuple[int, bool, int]:
    """state.consume of text's tokens as a fresh sequence's first outputs, and their number."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return *state.consume(Sequence([1], None), token_ids), len(token_ids)


@pytest.mark.parametrize(("constraint", "field", "reason"), [
    (Constraint("json_schema", '{"type": "foo"}'), "constraint.json_schema", "Invalid type: foo"),
    (Constraint("json_schema", "false"), "constraint.json_schema", "Unsatisfiable"),
    (Constraint("regex", "a(b"), "constraint.regex", "unclosed group"),
    (Constraint("grammar", "start: foo"), "constraint.grammar", 'unknown name: "foo"'),
    (Constraint("regex", "(x){0}"), "constraint.regex", "allows only the empty output"),
])
def test_a_malformed_constraint_names_its_field_and_the_reason(compiler, constraint, field, reason) -> None:
    with pytest.raises(RequestError) as caught:
        compile_now(compiler, constraint)
    message = str(caught.value)
    assert message.startswith(f"{field}: ") and reason in message


def test_errors_are_cached_too(compiler) -> None:
    for _ in range(2):
        with pytest.raises(RequestError):
            compile_now(compiler, Constraint("regex", "a(b"))
    assert compiler.num_compiled == 1


def test_a_compilation_past_the_limit_fails_without_holding_up_the_loop(tokenizer) -> None:
    def slow(constraint: Constraint, vocabulary: Vocabulary) -> Grammar:
        time.sleep(0.5)
        return compile_grammar(constraint, vocabulary)

    compiler = ConstraintCompiler(tokenizer, max_compile_ms=50, compile_fn=slow)
    compiler.prepare(VOCAB_SIZE, {tokenizer.eos_token_id})

    async def attempt() -> float:
        started = time.perf_counter()
        with pytest.raises(RequestError) as caught:
            await compiler.compile(Constraint("regex", "[0-9]+"), VOCAB_SIZE, {tokenizer.eos_token_id})
        assert str(caught.value) == ("constraint.regex: compiling it took longer than the limit of 50 ms "
                                     "(max_grammar_compile_ms); simplify it")
        return time.perf_counter() - started

    try:
        assert asyncio.run(attempt()) < 0.4  # the compile goes on in its thread; the caller does not wait
        asyncio.run(attempt())  # its result was dropped: compiled again, and late again
        assert compiler.num_compiled == 2
    finally:
        compiler.close()


def test_a_real_grammar_past_a_tiny_limit(tokenizer) -> None:
    compiler = ConstraintCompiler(tokenizer, max_compile_ms=1)
    big = "(" + "|".join(f"word{i}x{i * 7}" for i in range(4000)) + ")"  # about 20 ms to compile
    try:
        compiler.prepare(VOCAB_SIZE, {tokenizer.eos_token_id})
        with pytest.raises(RequestError, match=r"^constraint\.regex: .*limit of 1 ms"):
            compile_now(compiler, Constraint("regex", big))
    finally:
        compiler.close()


def test_the_cache_serves_a_constraint_once_compiled_and_evicts_the_oldest(tokenizer) -> None:
    compiler = ConstraintCompiler(tokenizer, max_compile_ms=2000, max_cached=2)
    try:
        first = compile_now(compiler, Constraint("regex", "[a-z]+"))
        assert compile_now(compiler, Constraint("regex", "[a-z]+")) is first
        assert compiler.num_compiled == 1
        compile_now(compiler, Constraint("regex", "[0-9]+"))
        compile_now(compiler, Constraint("choice", ("yes", "no")))
        assert compiler.num_compiled == 3
        assert compile_now(compiler, Constraint("regex", "[a-z]+")) is not first  # evicted, compiled again
        assert compiler.num_compiled == 4
        # Another vocabulary (a lane serving another model) has its own entry.
        other = compiler.compile_now(Constraint("regex", "[0-9]+"), VOCAB_SIZE + 32, {tokenizer.eos_token_id})
        assert other.fits(VOCAB_SIZE + 32, [tokenizer.eos_token_id]) and not other.fits(VOCAB_SIZE, [0])
    finally:
        compiler.close()


def test_concurrent_requests_for_one_constraint_share_its_compilation(compiler) -> None:
    async def three() -> list:
        constraint = Constraint("json_schema", json.dumps(SCHEMA))
        eos = {compiler.tokenizer.eos_token_id}
        return await asyncio.gather(*(compiler.compile(constraint, VOCAB_SIZE, eos) for _ in range(3)))

    first, second, third = asyncio.run(three())
    assert first is second is third and compiler.num_compiled == 1


def test_choices_with_quotes_backslashes_and_newlines_match_exactly(compiler, tokenizer) -> None:
    choices = ('say "hi"', "back\\slash", "two\nlines", "日本", "a", "ab")
    compiled = compile_now(compiler, Constraint("choice", choices))
    for choice in choices:
        state = compiled.new_state()
        num_consumed, is_complete, num_tokens = consume_text(state, tokenizer, choice)
        assert num_consumed == num_tokens
        assert is_complete == state.is_complete == (choice != "a")  # "a" may still go on to "ab"
    state = compiled.new_state()
    assert consume_text(state, tokenizer, "nope")[:2] == (0, False) and "fails" in state.error


def test_json_is_compact_and_any_json_object_works(compiler, tokenizer) -> None:
    for constraint in (Constraint("json_schema", json.dumps(SCHEMA)), Constraint("json_object")):
        compiled = compile_now(compiler, constraint)
        num_consumed, is_complete, num_tokens = consume_text(compiled.new_state(), tokenizer, '{"name":"Al","age":3}')
        assert (num_consumed, is_complete) == (num_tokens, True)
        num_consumed, _, num_tokens = consume_text(compiled.new_state(), tokenizer, '{"name": "Al"')
        assert num_consumed < num_tokens


def test_a_tokenizer_llguidance_cannot_read_is_refused_by_name(tmp_path) -> None:
    from scheduler_service.api.tokenizer import load_tokenizer
    from tests.scheduler_service.public_server_harness import save_tiny_tokenizer

    word_level = load_tokenizer(str(save_tiny_tokenizer(tmp_path)))
    compiler = ConstraintCompiler(word_level, max_compile_ms=2000)
    try:
        assert compiler.is_supported  # not tried yet
        with pytest.raises(RequestError, match=r"^constraint: the grammar library cannot use this model's tokenizer"):
            compiler.compile_now(Constraint("regex", "[a-z]+"), 20, {1})
        assert not compiler.is_supported
    finally:
        compiler.close()


# The mask's wire form.

def reference_allowed(matcher: llguidance.LLMatcher, num_text_tokens: int) -> np.ndarray:
    """llguidance's own mask, as allowed ids (the padding past the tokenizer's tokens forbidden)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return bits[:num_text_tokens].nonzero()[0]


@pytest.fixture(scope="module")
def smollm_compiler():
    """The default model's 49,152 tokens, padded to 49,216 as a model's embedding may be."""
    from common.formats.default_model import default_model_path
    from scheduler_service.api.tokenizer import load_tokenizer

    compiler = ConstraintCompiler(load_tokenizer(default_model_path()), max_compile_ms=2000)
    yield compiler
    compiler.close()


@pytest.mark.parametrize(("constraint", "prefix", "form", "max_bytes", "vocab_size"), [
    (Constraint("json_schema", json.dumps(SCHEMA)), "", "allowed_ids", 8, 49152 + 64),  # '{"' alone
    # Free text, 64 padding ids.
    (Constraint("json_schema", json.dumps(SCHEMA)), '{"name":"Al', "forbidden_ids", 1100, 49152 + 64),
    (Constraint("regex", "[a-z ]+"), "ab", "allowed_bitmask", 6156, 49152 + 64),  # 33k tokens of 49k
    (Constraint("regex", "[a-m]+"), "ab", "allowed_ids", 2000, 49152 + 64),
    # Free text in Qwen3's 151,936 ids (as the H200 benchmark runs it): the bitmask ends with the
    # tokenizer's last token, 6 KB rather than 19 KB.
    (Constraint("json_schema", json.dumps(SCHEMA)), '{"name":"Al', "allowed_bitmask", 6156, 151936),
])
def test_the_mask_decodes_back_to_llguidances_mask(smollm_compiler, constraint, prefix, form, max_bytes,
                                                   vocab_size) -> None:
    tokenizer = smollm_compiler.tokenizer
    compiled = smollm_compiler.compile_now(constraint, vocab_size, {tokenizer.eos_token_id})
    seq = output_of(tokenizer, prefix)
    state = compiled.new_state()  # consumes the prefix as it writes the mask: a rebuilt sequence's way
    mask = worker_pb2.TokenMask()
    state.write_mask(seq, mask)
    assert mask.WhichOneof("form") == form
    assert mask.ByteSize() <= max_bytes <= (vocab_size + 7) // 8 + 4  # never larger than the bitmask
    reference = compiled.grammar.matcher.deep_copy()
    assert reference.consume_tokens(seq.output_token_ids)
    allowed = allowed_token_ids(mask, vocab_size)
    assert allowed.tolist() == reference_allowed(reference, tokenizer.vocab_size).tolist()
    assert allowed.max() < tokenizer.vocab_size  # the padded ids are never allowed


@pytest.mark.parametrize("num_allowed", [1, 7, 40, 256, 480, 509, 512])
def test_every_form_round_trips(num_allowed: int) -> None:
    rng = np.random.default_rng(num_allowed)
    allowed = np.sort(rng.choice(VOCAB_SIZE, num_allowed, replace=False))
    bits = np.zeros(VOCAB_SIZE, dtype=np.uint8)
    bits[allowed] = 1
    bitmask = np.packbits(bits, bitorder="little").view("<i4").copy()
    mask = worker_pb2.TokenMask()
    write_token_mask(bitmask, VOCAB_SIZE, mask)
    assert allowed_token_ids(mask, VOCAB_SIZE).tolist() == allowed.tolist()
    assert mask.ByteSize() <= VOCAB_SIZE // 8 + 4


def test_a_state_rebuilt_from_its_tokens_equals_the_one_that_consumed_them(compiler, tokenizer) -> None:
    compiled = compile_now(compiler, Constraint("json_schema", json.dumps(SCHEMA)))
    seq = output_of(tokenizer, '{"name":"Bo')
    walked = compiled.new_state()
    for index in range(seq.num_prompt_tokens, seq.num_tokens):  # one token at a time, as the engine appends
        step = Sequence(seq.token_ids[:index], None, num_prompt_tokens=1)
        assert walked.consume(step, [seq.token_ids[index]]) == (1, False)
    masks = [worker_pb2.TokenMask() for _ in range(3)]
    walked.write_mask(seq, masks[0])
    compiled.new_state().write_mask(seq, masks[1])  # rebuilt: catches up on the tokens seq holds
    fork = walked.fork()
    fork.write_mask(seq, masks[2])
    assert masks[0] == masks[1] == masks[2]
    assert walked.num_consumed == seq.num_output_tokens


def test_an_eos_id_past_the_tokenizers_tokens_is_allowed_once_the_grammar_accepts(compiler, tokenizer) -> None:
    padded_eos = VOCAB_SIZE - 1  # a random checkpoint's config may name one the tokenizer lacks
    compiled = compiler.compile_now(Constraint("regex", "[a-z]+"), VOCAB_SIZE, {tokenizer.eos_token_id, padded_eos})
    state, start = compiled.new_state(), Sequence([1], None)
    mask = worker_pb2.TokenMask()
    state.write_mask(start, mask)
    assert padded_eos not in allowed_token_ids(mask, VOCAB_SIZE)
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert state.consume(start, [letter]) == (1, False)
    after = Sequence([1, letter], None, num_prompt_tokens=1)
    mask = worker_pb2.TokenMask()
    state.write_mask(after, mask)
    assert {padded_eos, tokenizer.eos_token_id} <= set(allowed_token_ids(mask, VOCAB_SIZE).tolist())
    assert state.consume(after, [padded_eos]) == (1, True)
