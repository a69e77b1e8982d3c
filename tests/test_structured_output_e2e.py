"""Structured output end to end: the default model (SmolLM2-135M-Instruct, GGUF) in a worker process,
the scheduler's engine and public gRPC server in this process, requests over a real socket. Each
constrained output matches its constraint (json_schema parses and validates, regex matches, choice is
one of them), greedy and sampled, with a chat prompt, streamed, with stop strings and logprobs;
STOP when the grammar completes, LENGTH when max_tokens cuts it; and the refusals and limits. The
worker advances the grammars (--grammar-masks worker, the default); with the scheduler's masks
(a second worker and scheduler) greedy answers are the same, token for token."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from common.client import GenerationClient
from common.contract.config import SchedulerConfig
from common.formats.default_model import default_model_path
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from tests.services_harness import LINK, InProcessScheduler, free_port, start_worker, stop

pytestmark = pytest.mark.slow

STOP, LENGTH, STOP_SEQUENCE = (generate_pb2.FINISH_REASON_STOP, generate_pb2.FINISH_REASON_LENGTH,
                               generate_pb2.FINISH_REASON_STOP_SEQUENCE)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                         "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}}}}
ASK = [generate_pb2.ChatMessage(role="user", content="Describe a person called Ann as JSON.")]


@pytest.fixture(scope="module")
def services():
    """The worker's port and the scheduler (the worker advances the grammars)."""
    worker_port = free_port()
    worker = start_worker(default_model_path(), worker_port)
    scheduler = None
    try:
        scheduler = InProcessScheduler(default_model_path(), worker_port).start()
        with GenerationClient(scheduler.target) as client:
            client.wait_ready(timeout=600)  # the worker loads its model
        assert scheduler.engine.lanes[0].core.grammars_on_worker
        yield worker_port, scheduler
    finally:
        if scheduler is not None:
            scheduler.stop()
        stop(worker)


@pytest.fixture(scope="module")
def channel(services):
    with grpc.insecure_channel(services[1].target) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return generate_pb2_grpc.TextGenerationStub(channel)


def generate(stub, **fields) -> generate_pb2.GenerateResponse:
    fields.setdefault("max_tokens", 48)
    return stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=300)


def test_model_info_offers_constraints(stub) -> None:
    info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert info.has_constraints and info.max_grammar_compile_ms == 2000 and info.max_constraint_bytes == 65536


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_json_schema_answer_parses_and_validates(stub, temperature: float) -> None:
    response = generate(stub, chat=generate_pb2.ChatMessages(messages=ASK), temperature=temperature, seed=3,
                        max_tokens=80, constraint=generate_pb2.Constraint(json_schema=json.dumps(PERSON)))
    jsonschema.validate(json.loads(response.text), PERSON)
    assert response.finish_reason == STOP


def test_json_object_regex_and_choice(stub) -> None:
    response = generate(stub, text="A JSON object:", temperature=0, max_tokens=60,
                        constraint=generate_pb2.Constraint(json_object=True))
    assert isinstance(json.loads(response.text), dict) and response.finish_reason == STOP
    response = generate(stub, text="My phone number is", temperature=0.8, seed=5,
                        constraint=generate_pb2.Constraint(regex=r"\(\d{3}\) \d{3}-\d{4}"))
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", response.text) and response.finish_reason == STOP
    choices = ["Paris", "London", "Rome"]
    response = generate(stub, chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(
        role="user", content="What is the capital of France?")]), temperature=0, logprobs=True, top_logprobs=2,
        constraint=generate_pb2.Constraint(choice=generate_pb2.Choices(choices=choices)))
    assert response.text in choices and response.finish_reason == STOP  # a 135M model: not always Paris
    assert len(response.logprobs) == len(response.token_ids)
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in response.logprobs)


def test_max_tokens_cuts_a_constrained_answer_short(stub) -> None:
    response = generate(stub, chat=generate_pb2.ChatMessages(messages=ASK), temperature=0, max_tokens=5,
                        constraint=generate_pb2.Constraint(json_schema=json.dumps(PERSON)))
    assert response.finish_reason == LENGTH and len(response.token_ids) == 5
    assert response.text.startswith('{"name":')


def test_a_stop_string_ends_a_constrained_stream(stub) -> None:
    request = generate_pb2.GenerateRequest(text="Count: one, two,", temperature=0, max_tokens=48, stop=[","],
                                           constraint=generate_pb2.Constraint(regex="( [a-z]+,){5}"))
    deltas = list(stub.GenerateStream(request, timeout=300))
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == STOP_SEQUENCE and deltas[-1].matched_stop_string == ","
    assert re.fullmatch(" [a-z]+", text)


@pytest.mark.parametrize(("constraint", "message"), [
    (generate_pb2.Constraint(json_schema='{"type": "nope"}'), "constraint.json_schema: Invalid type: nope"),
    (generate_pb2.Constraint(regex="[0-9"), "constraint.regex: "),
    (generate_pb2.Constraint(grammar="start: missing"), "constraint.grammar: "),
])
def test_a_malformed_constraint_is_invalid_argument(stub, constraint, message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(stub, text="hi", constraint=constraint)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(message)


def vllm_generate(channel, prompt_ids: list[int], **sampling) -> list[vllm_engine_pb2.GenerateResponse]:
    stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    request = vllm_engine_pb2.GenerateRequest(tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt_ids),
                                              sampling_params=vllm_engine_pb2.SamplingParams(**sampling))
    return list(stub.Generate(request, timeout=300))


def test_vllm_engine_constraints_and_samples(stub, channel) -> None:
    """The gateway's dialect: its constraint oneof and n map onto ours; each complete names its sample."""
    prompt = list(stub.Tokenize(generate_pb2.TokenizeRequest(chat=generate_pb2.ChatMessages(messages=ASK)),
                                timeout=30).token_ids)
    completes = [r.complete for r in vllm_generate(channel, prompt, temperature=0.9, seed=4, n=2, max_tokens=80,
                                                    json_schema=json.dumps(PERSON))]
    assert sorted(c.index for c in completes) == [0, 1]
    for complete in completes:
        text = stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=complete.output_ids, skip_special_tokens=True),
                               timeout=30).text
        jsonschema.validate(json.loads(text), PERSON)
        assert complete.finish_reason == "stop"
    with pytest.raises(grpc.RpcError) as caught:
        vllm_generate(channel, prompt, regex="[0-9")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling_params.regex: ")


def test_the_scheduler_masks_give_the_same_greedy_answers(services, stub) -> None:
    """--grammar-masks scheduler (a second scheduler, which takes the worker over for a while): each step's
    mask from the scheduler's matcher, a constrained sequence skipping the lookahead. A lone greedy request
    computes the same batches either way: the same tokens."""
    requests = [dict(chat=generate_pb2.ChatMessages(messages=ASK), temperature=0, max_tokens=40,
                     constraint=generate_pb2.Constraint(json_schema=json.dumps(PERSON))),
                dict(text="My phone number is", temperature=0,
                     constraint=generate_pb2.Constraint(regex=r"\(\d{3}\) \d{3}-\d{4}"))]
    expected = [list(generate(stub, **request).token_ids) for request in requests]
    worker_port, scheduler = services
    masked = InProcessScheduler(default_model_path(), worker_port, SchedulerConfig(grammar_masks="scheduler"),
                                link=replace(LINK, takeover=True))
    try:
        masked.start()
        with GenerationClient(masked.target) as client:
            client.wait_ready(timeout=60)
        assert not masked.engine.lanes[0].core.grammars_on_worker
        with grpc.insecure_channel(masked.target) as channel:
            masked_stub = generate_pb2_grpc.TextGenerationStub(channel)
            assert [list(generate(masked_stub, **request).token_ids) for request in requests] == expected
    finally:
        masked.stop()  # ends its session: the module's scheduler claims the worker back
    with GenerationClient(scheduler.target) as client:
        client.wait_ready(timeout=60)
    assert generate(stub, text="hi", max_tokens=2).token_ids  # served again (recomputed if it was under way)
