"""Constrained sequences in the engine core (no worker: replies made here, sampled from each step's
token masks): outputs that match their constraint, STOP once the grammar completes and LENGTH when
max_tokens comes first, EOS only once the grammar accepts, the lookahead rule (no constrained
sequence scheduled with a token pending; one decode iteration per step), preemption and worker loss
resuming from the same matcher state, and a forbidden token failing its request alone. With the
worker advancing grammars (attach(grammars_on_worker=True), replies from a fake that does): a
constrained sequence runs every step with its grammar sent once, no mask, and still ends as above."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from common.contract.config import SchedulerConfig
from common.contract.constraint import Constraint
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.api.tokenizer import Tokenizer
from scheduler_service.constraints import ConstraintCompiler, allowed_token_ids
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.sequence import FinishReason, Sequence
from tests.scheduler_service.constraint_helpers import (
    VOCAB_SIZE,
    GrammarSampler,
    masked_reply,
    messages,
    tiny_tokenizer,
    worker_info,
)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "size"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "size": {"enum": ["S", "M", "L"]}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer):
    compiler = ConstraintCompiler(tokenizer, max_compile_ms=2000)
    yield compiler
    compiler.close()


def attached(tokenizer: Tokenizer, grammars_on_worker: bool = False, **config) -> EngineCore:
    core = EngineCore(SchedulerConfig(**config))
    core.attach(worker_info(tokenizer), 64, grammars_on_worker=grammars_on_worker)
    return core


def add(core: EngineCore, compiler: ConstraintCompiler, tokenizer: Tokenizer, constraint: Constraint | None,
        **params) -> Sequence:
    compiled = None if constraint is None else compiler.compile_now(constraint, VOCAB_SIZE, core.eos_token_ids)
    return core.add_request(tokenizer.encode("hello world"), SamplingParams(constraint=constraint, **params),
                            tokenizer, compiled.new_state if compiled is not None else None)


def run_to_end(core: EngineCore, rng: random.Random, pick=None, max_steps: int = 500) -> None:
    """Steps as drive() runs them: step N+1 built before step N's reply is read back."""
    in_flight = None
    for _ in range(max_steps):
        step = core.build_step()
        if in_flight is not None:
            core.process_step(in_flight, masked_reply(in_flight, rng, pick))
        in_flight = step
        if in_flight is None and not core.num_unfinished:
            return
    raise AssertionError("did not finish")


def text_of(tokenizer: Tokenizer, seq: Sequence) -> str:
    return tokenizer.decode(seq.output_token_ids)


@pytest.mark.parametrize("seed", range(4))
def test_constrained_outputs_match_and_stop_when_the_grammar_completes(compiler, tokenizer, seed: int) -> None:
    core = attached(tokenizer)
    schema = add(core, compiler, tokenizer, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=200)
    regex = add(core, compiler, tokenizer, Constraint("regex", r"[0-9]{3}-[a-z]{2}"), max_tokens=200)
    choice = add(core, compiler, tokenizer, Constraint("choice", ("red", "green", 'say "blue"')), max_tokens=200)
    free = add(core, compiler, tokenizer, None, max_tokens=30)
    run_to_end(core, random.Random(seed))
    jsonschema.validate(json.loads(text_of(tokenizer, schema)), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_of(tokenizer, regex))
    assert text_of(tokenizer, choice) in ("red", "green", 'say "blue"')
    for seq in (schema, regex, choice):
        assert seq.finish_reason is FinishReason.STOP and seq.detokenizer.text == text_of(tokenizer, seq)
    assert free.finish_reason is FinishReason.LENGTH and free.num_output_tokens == 30


def test_max_tokens_cuts_a_constrained_output_short(compiler, tokenizer) -> None:
    core = attached(tokenizer)
    seq = add(core, compiler, tokenizer, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=4)
    run_to_end(core, random.Random(0))
    assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 4


def test_eos_is_allowed_only_once_the_grammar_accepts(compiler, tokenizer) -> None:
    core = attached(tokenizer)
    seq = add(core, compiler, tokenizer, Constraint("regex", "[a-z]+"), max_tokens=50)
    eos = tokenizer.eos_token_id
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    step = core.build_step()
    (message,) = messages(step)
    assert eos not in allowed_token_ids(message.token_mask, VOCAB_SIZE)
    core.process_step(step, masked_reply(step, random.Random(0), pick=lambda allowed: letter))
    step = core.build_step()
    (message,) = messages(step)
    assert eos in allowed_token_ids(message.token_mask, VOCAB_SIZE)
    core.process_step(step, masked_reply(step, random.Random(0), pick=lambda allowed: eos))
    assert seq.finish_reason is FinishReason.STOP and seq.output_token_ids == [letter, eos]


def test_a_constrained_sequence_waits_for_its_pending_token_and_decodes_one_token_per_step(compiler,
                                                                                          tokenizer) -> None:
    core = attached(tokenizer, num_decode_steps=4)
    constrained = add(core, compiler, tokenizer, Constraint("regex", "[a-z]{40}"), max_tokens=60)
    free = add(core, compiler, tokenizer, None, max_tokens=60)
    rng = random.Random(0)
    prefill = core.build_step()
    ahead = core.build_step()  # built while the prefill runs: the constrained one's first token is pending
    assert set(ahead.scheduled) == {free.seq_id} and ahead.request.num_decode_steps == 1
    assert not any(m.HasField("token_mask") for m in messages(ahead))
    core.process_step(prefill, masked_reply(prefill, rng))
    after = core.build_step()  # its token is known now: it decodes, under its mask (free text goes on regardless)
    assert set(after.scheduled) == {constrained.seq_id, free.seq_id} and after.request.num_decode_steps == 1
    assert [m.seq_id for m in messages(after) if m.HasField("token_mask")] == [constrained.seq_id]
    core.process_step(ahead, masked_reply(ahead, rng))
    core.process_step(after, masked_reply(after, rng))
    core.abort(constrained)
    assert core.build_step().request.num_decode_steps == 4  # free text alone: several iterations again
    assert constrained.num_output_tokens == 2 and re.fullmatch("[a-z]+", text_of(tokenizer, constrained))


def test_a_preempted_or_recomputed_sequence_goes_on_from_the_tokens_it_holds(compiler, tokenizer) -> None:
    core = attached(tokenizer)
    seq = add(core, compiler, tokenizer, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=200)
    rng = random.Random(3)
    for _ in range(6):
        step = core.build_step()
        core.process_step(step, masked_reply(step, rng))
    lost = core.build_step()  # in flight when the worker is lost: its token never counts
    before = worker_pb2.TokenMask()
    before.CopyFrom(messages(lost)[0].token_mask)
    core.detach()
    assert seq.constraint_state.num_consumed == seq.num_output_tokens == 6
    core.attach(worker_info(tokenizer), 64)
    recompute = core.build_step()
    (message,) = recompute.request.new_sequences
    assert list(message.token_ids) == seq.token_ids and message.token_mask == before
    core.process_step(recompute, masked_reply(recompute, rng))
    run_to_end(core, rng)
    jsonschema.validate(json.loads(text_of(tokenizer, seq)), SCHEMA)
    assert seq.finish_reason is FinishReason.STOP and seq.num_preemptions == 1


def test_a_token_the_constraint_forbids_fails_that_request_alone(compiler, tokenizer) -> None:
    core = attached(tokenizer)
    constrained = add(core, compiler, tokenizer, Constraint("regex", "[0-9]+"), max_tokens=20)
    free = add(core, compiler, tokenizer, None, max_tokens=20)
    step = core.build_step()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    response = worker_pb2.StepResponse(step_id=step.step_id)
    response.tokens.add(seq_id=constrained.seq_id, token_id=letter)  # a worker that ignored the mask
    response.tokens.add(seq_id=free.seq_id, token_id=7)
    outputs = core.process_step(step, response)
    assert [o.seq_id for o in outputs] == [free.seq_id]
    assert core.take_failed_seq_ids() == [constrained.seq_id] and core.take_failed_seq_ids() == []
    assert constrained.finish_reason is FinishReason.ABORTED and constrained.output_token_ids == []
    assert not free.is_finished and free.output_token_ids == [7]


# The worker advances the grammars.

def run_with_worker_grammars(core: EngineCore, sampler: GrammarSampler, max_steps: int = 500) -> None:
    """run_to_end against a worker that advances grammars itself."""
    in_flight = None
    for _ in range(max_steps):
        step = core.build_step()
        if in_flight is not None:
            core.process_step(in_flight, sampler.reply(in_flight.step_id, in_flight.request))
        in_flight = step
        if in_flight is None and not core.num_unfinished:
            return
    raise AssertionError("did not finish")


def sampler_for(core: EngineCore, compiler: ConstraintCompiler, seed: int) -> GrammarSampler:
    return GrammarSampler(compiler.grammar_tokenizer(VOCAB_SIZE, core.eos_token_ids), random.Random(seed))


def test_with_worker_grammars_a_constrained_sequence_runs_every_step(compiler, tokenizer) -> None:
    """Its grammar goes once, in its NewSequence, with no output token yet; no step carries a mask; it is
    scheduled in the step built while its first token is pending, and in steps of several decode
    iterations (the worker reads each iteration's token back for the next mask)."""
    core = attached(tokenizer, grammars_on_worker=True, num_decode_steps=4)
    regex = Constraint("regex", "[a-z]{400}")  # more characters than 25 tokens hold: it never completes here
    constrained = add(core, compiler, tokenizer, regex, max_tokens=60)
    free = add(core, compiler, tokenizer, None, max_tokens=60)
    sampler = sampler_for(core, compiler, 0)
    prefill = core.build_step()
    (message, _) = prefill.request.new_sequences
    assert message.grammar.grammar == compiler.compile_now(regex, VOCAB_SIZE, core.eos_token_ids).grammar.text
    assert list(message.grammar.output_token_ids) == [] and not message.HasField("token_mask")
    assert not prefill.request.new_sequences[1].HasField("grammar")
    ahead = core.build_step()  # built while the prefill runs: the constrained one decodes too
    assert set(ahead.scheduled) == {constrained.seq_id, free.seq_id}
    num_iterations = [ahead.request.num_decode_steps]
    for _ in range(5):
        core.process_step(prefill, sampler.reply(prefill.step_id, prefill.request))
        prefill, ahead = ahead, core.build_step()
        assert set(ahead.scheduled) == {constrained.seq_id, free.seq_id}
        assert not any(m.HasField("token_mask") for m in messages(ahead))
        num_iterations.append(ahead.request.num_decode_steps)
    core.process_step(prefill, sampler.reply(prefill.step_id, prefill.request))
    core.process_step(ahead, sampler.reply(ahead.step_id, ahead.request))
    assert num_iterations[-1] == 4
    assert constrained.num_output_tokens == 1 + sum(num_iterations)
    assert re.fullmatch("[a-z]+", text_of(tokenizer, constrained))
    assert constrained.constraint_state.num_consumed == constrained.num_output_tokens and sampler.num_grammars == 1


@pytest.mark.parametrize("seed", range(3))
def test_with_worker_grammars_outputs_match_and_stop_when_the_grammar_completes(compiler, tokenizer,
                                                                                 seed: int) -> None:
    """The scheduler's matcher ends each request as with masks; the token of the step launched after the
    completing one (EOS) is dropped, and never consumed."""
    core = attached(tokenizer, grammars_on_worker=True)
    schema = add(core, compiler, tokenizer, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=200)
    regex = add(core, compiler, tokenizer, Constraint("regex", r"[0-9]{3}-[a-z]{2}"), max_tokens=200)
    cut = add(core, compiler, tokenizer, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=4)
    free = add(core, compiler, tokenizer, None, max_tokens=30)
    run_with_worker_grammars(core, sampler_for(core, compiler, seed))
    jsonschema.validate(json.loads(text_of(tokenizer, schema)), SCHEMA)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_of(tokenizer, regex))
    for seq in (schema, regex):
        assert seq.finish_reason is FinishReason.STOP and seq.constraint_state.is_complete
        assert seq.constraint_state.num_consumed == seq.num_output_tokens
    assert cut.finish_reason is FinishReason.LENGTH and cut.constraint_state.num_consumed == cut.num_output_tokens == 4
    assert free.finish_reason is FinishReason.LENGTH and free.num_output_tokens == 30


def test_with_worker_grammars_a_recomputed_sequence_sends_its_output_tokens(compiler, tokenizer) -> None:
    """After a lost worker the sequence goes again as a NewSequence whose grammar lists every output token
    it holds (none of the step in flight when the worker was lost), and ends as undisturbed."""
    core = attached(tokenizer, grammars_on_worker=True, num_decode_steps=1)  # one token a step: 6 before the loss
    seq = add(core, compiler, tokenizer, Constraint("json_schema", json.dumps(SCHEMA)), max_tokens=200)
    sampler = sampler_for(core, compiler, 3)
    in_flight = core.build_step()
    for _ in range(6):
        step = core.build_step()
        core.process_step(in_flight, sampler.reply(in_flight.step_id, in_flight.request))
        in_flight = step
    core.detach()  # with a step in flight: its token never counts
    assert seq.constraint_state.num_consumed == seq.num_output_tokens == 6
    core.attach(worker_info(tokenizer), 64, grammars_on_worker=True)
    sampler = sampler_for(core, compiler, 4)  # the new worker knows nothing
    recompute = core.build_step()
    (message,) = recompute.request.new_sequences
    assert list(message.token_ids) == seq.token_ids
    assert list(message.grammar.output_token_ids) == seq.output_token_ids
    core.process_step(recompute, sampler.reply(recompute.step_id, recompute.request))
    run_with_worker_grammars(core, sampler)
    jsonschema.validate(json.loads(text_of(tokenizer, seq)), SCHEMA)
    assert seq.finish_reason is FinishReason.STOP and seq.num_preemptions == 1
