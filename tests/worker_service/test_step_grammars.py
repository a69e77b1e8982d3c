"""Grammars the worker advances itself (NewSequence.grammar, the session's InitCache carrying the grammar
tokenizer), through whole worker steps (a tiny random Qwen3 on the CPU, float32, and the tiny BPE
tokenizer): over decode steps launched with a scheduler's lookahead (step N+1 before step N is read
back) a grammar's rows sample only what it allows, and the very tokens of the scheduler-mask path (a
TokenMask per step from the scheduler's own matcher), greedy and seeded, beside free text; a recomputed
sequence (its output tokens given) goes on as the undisturbed one; a completed grammar allows EOS alone;
malformed steps are ValueErrors naming the field."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from common.contract.constraint import Constraint
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.constraints import CompiledConstraint, ConstraintCompiler
from scheduler_service.core.sequence import Sequence
from tests.scheduler_service.constraint_helpers import VOCAB_SIZE, tiny_tokenizer
from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.step_driver import DEVICES, StepDriver, running, tokens_of, worker_config
from tests.worker_service.test_logit_edits import allowed_ids
from worker_service.runtime.worker import WorkerCore

P = SamplingParams
PROMPT = [5, 17, 300, 42, 8, 99, 123, 7, 64, 1, 250, 3]
MODEL_EOS = VOCAB_SIZE - 1  # the tiny checkpoint's eos_token_id: past the tokenizer's 474 tokens
NUM_STEPS = 8
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}}}
# Long enough that NUM_STEPS tokens never complete them: every step's choice is the model's.
FREE_TEXT = Constraint("regex", "[a-z ]{60,90}")
JSON = Constraint("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("grammars"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def eos_ids(tokenizer) -> frozenset[int]:
    return frozenset({tokenizer.eos_token_id, MODEL_EOS})


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = ConstraintCompiler(tokenizer, max_compile_ms=5000)
    yield compiler
    compiler.close()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def driver(model: Path, device: str, compiler, eos_ids) -> StepDriver:
    spec = compiler.grammar_tokenizer(VOCAB_SIZE, eos_ids)
    return StepDriver(WorkerCore(worker_config(model, device)), grammar_tokenizer=spec.to_proto())


def compiled(compiler: ConstraintCompiler, eos_ids, constraint: Constraint) -> CompiledConstraint:
    return compiler.compile_now(constraint, VOCAB_SIZE, eos_ids)


def with_grammar(message: worker_pb2.NewSequence, grammar: CompiledConstraint | str,
                 output_token_ids: list[int] = ()) -> worker_pb2.NewSequence:
    """message with the grammar (compiled by the scheduler, or a text) and the output tokens it holds."""
    message.grammar.grammar = grammar if isinstance(grammar, str) else grammar.grammar.text
    message.grammar.output_token_ids.extend(output_token_ids)
    return message


Rows = dict[int, tuple[SamplingParams, CompiledConstraint | None]]


def collect(outputs: dict[int, list[int]], response: worker_pb2.StepResponse) -> None:
    for seq_id, tokens in outputs.items():
        tokens += tokens_of(response, seq_id)


def run_worker_grammars(driver: StepDriver, rows: Rows, num_steps: int = NUM_STEPS) -> dict[int, list[int]]:
    """The rows' tokens with the worker's matchers, every step launched before the previous is read back."""
    new = [with_grammar(driver.new(seq_id, PROMPT, params), grammar) if grammar else driver.new(seq_id, PROMPT, params)
           for seq_id, (params, grammar) in rows.items()]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in rows}
    in_flight = driver.launch(new)
    for _ in range(num_steps - 1):
        ahead = driver.launch(running=[running(seq_id) for seq_id in rows])
        collect(outputs, in_flight.result())
        in_flight = ahead
    collect(outputs, in_flight.result())
    return outputs


def run_scheduler_masks(driver: StepDriver, rows: Rows, num_steps: int = NUM_STEPS) -> dict[int, list[int]]:
    """The rows' tokens under the scheduler's masks: each step's from its matcher, once the last token is in."""
    sequences = {seq_id: Sequence(list(PROMPT), params) for seq_id, (params, _) in rows.items()}
    states = {seq_id: grammar.new_state() for seq_id, (_, grammar) in rows.items() if grammar is not None}

    def mask(seq_id: int) -> worker_pb2.TokenMask | None:
        if seq_id not in states:
            return None
        message = worker_pb2.TokenMask()
        states[seq_id].write_mask(sequences[seq_id], message)
        return message

    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in rows}
    response = driver.step([driver.new(seq_id, PROMPT, params, mask=mask(seq_id))
                            for seq_id, (params, _) in rows.items()])
    for step in range(num_steps):
        for seq_id in rows:
            (token,) = tokens_of(response, seq_id)
            outputs[seq_id].append(token)
            if seq_id in states:
                states[seq_id].consume(sequences[seq_id], [token])
            sequences[seq_id].token_ids.append(token)
        if step < num_steps - 1:
            response = driver.step(running=[running(seq_id, mask=mask(seq_id)) for seq_id in rows])
    return outputs


def until_eos(tokens: list[int], eos_ids) -> list[int]:
    """The tokens up to the first EOS, included: where the scheduler ends the sequence."""
    for index, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:index + 1]
    return tokens


def assert_allowed(grammar: CompiledConstraint, tokens: list[int], eos_ids) -> None:
    """The scheduler's matcher takes every token up to the first EOS."""
    tokens = until_eos(tokens, eos_ids)
    num_valid, is_complete = grammar.new_state().consume(Sequence(list(PROMPT), P()), tokens)
    assert num_valid == len(tokens) or (is_complete and num_valid == len(tokens) - 1 and tokens[-1] in eos_ids)


def test_grammar_rows_sample_what_the_scheduler_masks_give(model: Path, device: str, compiler, eos_ids,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Greedy and seeded rows under a free-text regex and a JSON schema, a free row and an unseeded sampled
    row beside them: with lookahead launches, the same tokens as one step at a time under the scheduler's
    masks, each allowed by the grammar; the free row's tokens are the same too."""
    free_text, json_schema = compiled(compiler, eos_ids, FREE_TEXT), compiled(compiler, eos_ids, JSON)
    rows: Rows = {1: (P(temperature=0.0), free_text), 2: (P(temperature=0.9, seed=5), free_text),
                  3: (P(temperature=0.0), json_schema), 4: (P(temperature=0.8, seed=2), json_schema),
                  5: (P(temperature=0.0), None), 6: (P(temperature=1.0), free_text)}
    spec = compiler.grammar_tokenizer(VOCAB_SIZE, eos_ids).to_proto()
    with caplog.at_level(logging.ERROR, logger="worker_service.sampling.grammar_matchers"):
        on_worker = run_worker_grammars(StepDriver(WorkerCore(worker_config(model, device)),
                                                   grammar_tokenizer=spec), rows)
    assert not caplog.records
    with_masks = run_scheduler_masks(StepDriver(WorkerCore(worker_config(model, device))), rows)
    for seq_id in (1, 2, 3, 4, 5):
        assert until_eos(on_worker[seq_id], eos_ids) == until_eos(with_masks[seq_id], eos_ids), seq_id
    for seq_id, (_, grammar) in rows.items():
        if grammar is not None:
            assert len(on_worker[seq_id]) == NUM_STEPS
            assert_allowed(grammar, on_worker[seq_id], eos_ids)
    assert on_worker[3][0] == on_worker[4][0]  # '{"' and the rest are forced: one token allowed


def test_a_recomputed_sequence_goes_on_as_the_undisturbed_one(driver: StepDriver, compiler, eos_ids) -> None:
    """Sent again with the first k output tokens among its tokens to compute and in grammar.output_token_ids
    (as after a lost worker or a preemption), a greedy and a seeded row sample the undisturbed run's rest."""
    free_text, json_schema = compiled(compiler, eos_ids, FREE_TEXT), compiled(compiler, eos_ids, JSON)
    rows: Rows = {1: (P(temperature=0.0), json_schema), 2: (P(temperature=0.9, seed=7), free_text)}
    undisturbed = run_worker_grammars(driver, rows)
    k = 3
    new = []
    for seq_id, (params, grammar) in rows.items():
        outputs = undisturbed[seq_id][:k]
        message = worker_pb2.NewSequence(seq_id=seq_id + 10, token_ids=PROMPT + outputs,
                                         num_tokens=len(PROMPT) + k, num_prompt_tokens=len(PROMPT),
                                         block_table=driver.blocks(), sampling=params.to_proto())
        new.append(with_grammar(message, grammar, outputs))
    recomputed: dict[int, list[int]] = {seq_id + 10: [] for seq_id in rows}
    in_flight = driver.launch(new, released=list(rows))
    for _ in range(NUM_STEPS - k - 1):
        ahead = driver.launch(running=[running(seq_id) for seq_id in recomputed])
        collect(recomputed, in_flight.result())
        in_flight = ahead
    collect(recomputed, in_flight.result())
    for seq_id in rows:
        assert recomputed[seq_id + 10] == undisturbed[seq_id][k:]


def test_a_completed_grammar_allows_eos_alone(driver: StepDriver, compiler, eos_ids,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """A one-choice grammar is forced token by token; then, completed, only EOS comes, in the steps launched
    before the scheduler would have seen the completion too, and taking it is no error."""
    choice = compiled(compiler, eos_ids, Constraint("choice", ("yes",)))
    with caplog.at_level(logging.ERROR, logger="worker_service.sampling.grammar_matchers"):
        outputs = run_worker_grammars(driver, {1: (P(temperature=1.0, seed=3), choice)}, num_steps=8)[1]
    assert not caplog.records
    forced = until_eos(outputs, eos_ids)
    assert compiler.tokenizer.decode(forced[:-1]) == "yes"
    assert set(outputs[len(forced) - 1:]) <= eos_ids


@pytest.mark.parametrize(("change", "message"), [
    (lambda d, g: with_grammar(d.new(1, PROMPT, P(), mask=allowed_ids(3)), g),
     r"^sequence 1: grammar: not allowed with a token_mask$"),
    (lambda d, g: with_grammar(d.new(1, PROMPT, P()), g, [3, 512]),
     r"^sequence 1: grammar\.output_token_ids: ids must be in \[0, 512\), got 512$"),
    (lambda d, g: with_grammar(d.new(1, PROMPT, P()), "start: missing"),
     r"^sequence 1: grammar: the grammar library refused it"),
], ids=["with_mask", "output_id", "refused"])
def test_malformed_grammars_are_value_errors_naming_the_field(driver: StepDriver, compiler, eos_ids, change,
                                                              message: str) -> None:
    grammar = compiled(compiler, eos_ids, FREE_TEXT)
    with pytest.raises(ValueError, match=message):
        driver.step([change(driver, grammar)])


def test_a_grammar_sequence_takes_no_mask(driver: StepDriver, compiler, eos_ids) -> None:
    grammar = compiled(compiler, eos_ids, FREE_TEXT)
    driver.step([with_grammar(driver.new(1, PROMPT, P(temperature=0.0)), grammar)])
    with pytest.raises(ValueError, match=r"^sequence 1: token_mask: not allowed for a sequence with a grammar$"):
        driver.step(running=[running(1, mask=allowed_ids(3))])


def test_multi_iteration_steps_sample_what_single_iteration_steps_do(model: Path, device: str, compiler,
                                                                      eos_ids) -> None:
    """Grammar rows (greedy, seeded) beside a free row in steps of 4 decode iterations, launched with
    lookahead: the worker reads each iteration's tokens of the grammar rows back for the next mask, and
    the tokens are those of one iteration per step, each allowed."""
    free_text, json_schema = compiled(compiler, eos_ids, FREE_TEXT), compiled(compiler, eos_ids, JSON)
    rows: Rows = {1: (P(temperature=0.0), json_schema), 2: (P(temperature=0.9, seed=5), free_text),
                  3: (P(temperature=0.0), None)}
    spec = compiler.grammar_tokenizer(VOCAB_SIZE, eos_ids).to_proto()
    single = run_worker_grammars(StepDriver(WorkerCore(worker_config(model, device)), grammar_tokenizer=spec), rows,
                                 num_steps=9)
    driver = StepDriver(WorkerCore(worker_config(model, device)), grammar_tokenizer=spec)
    new = [with_grammar(driver.new(seq_id, PROMPT, params), grammar) if grammar is not None
           else driver.new(seq_id, PROMPT, params) for seq_id, (params, grammar) in rows.items()]
    multi: dict[int, list[int]] = {seq_id: [] for seq_id in rows}
    in_flight = driver.launch(new)
    for _ in range(2):
        ahead = driver.launch(running=[running(seq_id) for seq_id in rows], num_decode_steps=4)
        collect(multi, in_flight.result())
        in_flight = ahead
    collect(multi, in_flight.result())
    assert multi == single
    for seq_id, (_, grammar) in rows.items():
        if grammar is not None:
            assert_allowed(grammar, multi[seq_id], eos_ids)


def test_a_session_without_a_grammar_tokenizer_refuses_grammars(model: Path, compiler, eos_ids) -> None:
    """None sent, or one the library cannot read (a warning; the scheduler's, given it, refuses it too);
    one of another vocabulary is refused at InitCache, before anything is dropped."""
    core = WorkerCore(worker_config(model, "cpu"))
    grammar = compiled(compiler, eos_ids, FREE_TEXT)
    unreadable = worker_pb2.GrammarTokenizer(tokenizer_json="{}", vocab_size=VOCAB_SIZE, num_text_tokens=10)
    for sent in (None, unreadable):
        driver = StepDriver(core, grammar_tokenizer=sent)
        with pytest.raises(ValueError, match=r"^sequence 1: grammar: this session has no grammar tokenizer"):
            driver.step([with_grammar(driver.new(1, PROMPT, P()), grammar)])
    wider = compiler.grammar_tokenizer(VOCAB_SIZE + 64, eos_ids).to_proto()
    with pytest.raises(ValueError, match=r"^grammar_tokenizer\.vocab_size: must be this worker's 512, got 576$"):
        core.init_cache(worker_pb2.InitCacheRequest(num_kv_blocks=8, session_id="other", grammar_tokenizer=wider))


def test_free_text_never_waits_for_the_previous_step(driver: StepDriver, compiler, eos_ids) -> None:
    """In a session with grammars, a step launched behind one whose tokens are still on the device does not
    read that one back unless a row under a grammar samples: here only the grammar's launch does."""
    grammar = compiled(compiler, eos_ids, FREE_TEXT)
    first = driver.launch([driver.new(1, PROMPT, P(temperature=0.0))])
    second = driver.launch(running=[running(1)])
    assert not first.is_read_back
    third = driver.launch([with_grammar(driver.new(2, PROMPT, P(temperature=0.0)), grammar)], [running(1)])
    assert not second.is_read_back  # a new sequence's grammar needs no earlier token
    driver.launch(running=[running(1), running(2)])
    assert third.is_read_back  # its token for sequence 2 had to be recorded first


def test_a_new_session_with_the_same_tokenizer_keeps_the_grammars(driver: StepDriver, compiler, eos_ids) -> None:
    built = driver.core.grammars
    spec = compiler.grammar_tokenizer(VOCAB_SIZE, eos_ids).to_proto()
    driver.core.init_cache(worker_pb2.InitCacheRequest(num_kv_blocks=8, session_id="next", grammar_tokenizer=spec))
    assert built is not None and driver.core.grammars is built
    driver.core.init_cache(worker_pb2.InitCacheRequest(num_kv_blocks=8, session_id="last"))
    assert driver.core.grammars is None
