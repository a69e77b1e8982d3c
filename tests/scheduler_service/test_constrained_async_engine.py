"""Constraints through the AsyncEngine and the public request conversion, against a scripted worker
that samples from each step's token mask (no torch): compiled before queuing, refused with
INVALID_ARGUMENT's RequestError when malformed or without a tokenizer, and a worker that ignores the
mask failing that request alone. A worker that runs alone (tensor_parallel_size 1) is sent the grammar
tokenizer and advances the grammars itself, unless --grammar-masks scheduler; one of several ranks
takes masks."""
from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import pytest

from common.contract.config import SchedulerConfig
from common.contract.constraint import MAX_CONSTRAINT_BYTES, Constraint
from common.contract.grammar_tokenizer import GrammarTokenizer
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.generate.v1 import generate_pb2
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.api import request_conversion
from scheduler_service.api.response_conversion import model_info_response
from scheduler_service.api.tokenizer import Tokenizer
from scheduler_service.constraints import allowed_token_ids
from scheduler_service.core.errors import RequestError, WorkerStepError
from scheduler_service.core.sequence import FinishReason
from scheduler_service.lanes.async_engine import AsyncEngine
from tests.scheduler_service.constraint_helpers import VOCAB_SIZE, GrammarSampler, tiny_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}


class MaskedWorker:
    """Speaks the Step protocol; samples a random allowed token under a mask (or forbidden_token, as a
    worker that ignores masks would), else token 5."""

    address = "masked"
    uses_tls = False

    def __init__(self, eos_token_id: int, forbidden_token: int | None = None) -> None:
        self.eos_token_id = eos_token_id
        self.forbidden_token = forbidden_token
        self.rng = random.Random(0)
        self.num_masks = 0

    async def describe(self) -> worker_pb2.DescribeResponse:
        return worker_pb2.DescribeResponse(model_name="masked", block_size=16, max_model_len=512,
                                           vocab_size=VOCAB_SIZE, num_kv_blocks=64, eos_token_ids=[self.eos_token_id])

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse:
        return worker_pb2.InitCacheResponse(num_kv_blocks=num_kv_blocks)

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        await asyncio.sleep(0)
        response = worker_pb2.StepResponse(step_id=request.step_id)
        for message in (*request.new_sequences, *request.running_sequences):
            for _ in range(max(request.num_decode_steps, 1)):
                response.tokens.add(seq_id=message.seq_id, token_id=self._sample(message))
        return response

    def _sample(self, message) -> int:
        if not message.HasField("token_mask"):
            return 5
        self.num_masks += 1
        if self.forbidden_token is not None:
            return self.forbidden_token
        return int(self.rng.choice(allowed_token_ids(message.token_mask, VOCAB_SIZE)))

    async def release(self, seq_ids: list[int]) -> None:
        pass

    async def heartbeat(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    async def end_session(self) -> None:
        pass

    async def close(self) -> None:
        pass


class GrammarWorker(MaskedWorker):
    """A worker of tensor_parallel_size ranks: advances the grammars itself when InitCache sends the grammar
    tokenizer (GrammarSampler), else samples from the masks."""

    def __init__(self, eos_token_id: int, tensor_parallel_size: int = 1) -> None:
        super().__init__(eos_token_id)
        self.tensor_parallel_size = tensor_parallel_size
        self.grammar_tokenizer: worker_pb2.GrammarTokenizer | None = None
        self.sampler: GrammarSampler | None = None

    async def describe(self) -> worker_pb2.DescribeResponse:
        response = await super().describe()
        response.tensor_parallel_size = self.tensor_parallel_size
        return response

    async def init_cache(self, num_kv_blocks: int,
                         grammar_tokenizer: worker_pb2.GrammarTokenizer | None = None) -> worker_pb2.InitCacheResponse:
        self.grammar_tokenizer = grammar_tokenizer
        if grammar_tokenizer is not None:
            self.sampler = GrammarSampler(GrammarTokenizer.from_proto(grammar_tokenizer), random.Random(0))
        return await super().init_cache(num_kv_blocks)

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        if self.sampler is None:
            return await super().step(request, timeout_s)
        await asyncio.sleep(0)
        return self.sampler.reply(request.step_id, request)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return tiny_tokenizer(tmp_path_factory.mktemp("bpe"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def started(worker: MaskedWorker, tokenizer: Tokenizer | None, **config) -> AsyncEngine:
    engine = await AsyncEngine.start(SchedulerConfig(**config), worker, tokenizer)
    await engine.wait_ready(timeout=5)
    return engine


async def collect(engine: AsyncEngine, params: SamplingParams) -> tuple[str, FinishReason | None]:
    text, reason = "", None
    async for output in engine.generate([3, 4, 5], params):
        text += output.text
        reason = output.finish_reason
    return text, reason


async def schema_regex_and_free(engine) -> list:
    """A JSON-schema request, a regex request and a free one, at once: each one's (text, finish reason)."""
    return await asyncio.gather(
        collect(engine, SamplingParams(max_tokens=100, constraint=Constraint("json_schema", json.dumps(SCHEMA)))),
        collect(engine, SamplingParams(max_tokens=100, constraint=Constraint("regex", "(ab|cd){3}"))),
        collect(engine, SamplingParams(max_tokens=20, ignore_eos=True)))


def check_schema_regex_and_free(results: list) -> None:
    (schema_text, schema_reason), (regex_text, regex_reason), (_, free_reason) = results
    jsonschema.validate(json.loads(schema_text), SCHEMA)
    assert re.fullmatch("(ab|cd){3}", regex_text)
    assert (schema_reason, regex_reason, free_reason) == (FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH)


def test_constrained_and_free_requests_run_together(tokenizer) -> None:
    async def scenario() -> list:
        engine = await started(MaskedWorker(tokenizer.eos_token_id), tokenizer)
        try:
            assert engine.has_constraints and engine.max_grammar_compile_ms == 2000
            return await schema_regex_and_free(engine)
        finally:
            await engine.shutdown(0)

    check_schema_regex_and_free(run(scenario()))


def test_a_malformed_constraint_or_no_tokenizer_is_refused_before_queuing(tokenizer) -> None:
    async def scenario(with_tokenizer: bool, constraint: Constraint) -> str:
        engine = await started(MaskedWorker(tokenizer.eos_token_id), tokenizer if with_tokenizer else None)
        try:
            with pytest.raises(RequestError) as caught:
                await collect(engine, SamplingParams(constraint=constraint))
            assert engine.num_unfinished == 0
            return str(caught.value)
        finally:
            await engine.shutdown(0)

    assert run(scenario(True, Constraint("regex", "[0-9"))).startswith("constraint.regex: ")
    assert run(scenario(False, Constraint("regex", "[0-9]"))) == "constraint: this model has no tokenizer"


def test_a_worker_that_ignores_the_mask_fails_that_request_alone(tokenizer) -> None:
    letter = tokenizer.encode("x", add_special_tokens=False)[0]

    async def scenario() -> tuple:
        engine = await started(MaskedWorker(tokenizer.eos_token_id, forbidden_token=letter), tokenizer)
        try:
            return await asyncio.gather(
                collect(engine, SamplingParams(max_tokens=10, constraint=Constraint("regex", "[0-9]+"))),
                collect(engine, SamplingParams(max_tokens=10, ignore_eos=True)), return_exceptions=True)
        finally:
            await engine.shutdown(0)

    failed, free = run(scenario())
    assert isinstance(failed, WorkerStepError) and "constraint forbids" in str(failed)
    assert free[1] is FinishReason.LENGTH


@pytest.mark.parametrize(("grammar_masks", "tensor_parallel_size", "on_worker"), [
    ("worker", 1, True), ("scheduler", 1, False), ("worker", 2, False)])
def test_who_advances_the_grammars(tokenizer, grammar_masks: str, tensor_parallel_size: int, on_worker: bool) -> None:
    """A worker that runs alone gets the tokenizer the lane's constraints compile against (its JSON, the
    lane's EOS ids, the worker's vocabulary) and each constrained sequence's grammar; with --grammar-masks
    scheduler, or several ranks, the worker gets masks. The outputs match their constraints either way."""
    worker = GrammarWorker(tokenizer.eos_token_id, tensor_parallel_size)

    async def scenario() -> list:
        engine = await started(worker, tokenizer, grammar_masks=grammar_masks)
        try:
            return await schema_regex_and_free(engine)
        finally:
            await engine.shutdown(0)

    check_schema_regex_and_free(run(scenario()))
    if not on_worker:
        assert worker.grammar_tokenizer is None and worker.num_masks > 0
        return
    sent = worker.grammar_tokenizer
    assert sent is not None and sent.tokenizer_json == tokenizer.backend.to_str()
    assert (sent.vocab_size, sent.num_text_tokens, list(sent.eos_token_ids)) == (
        VOCAB_SIZE, tokenizer.vocab_size, [tokenizer.eos_token_id])
    assert worker.sampler.num_grammars == 2 and worker.num_masks == 0


# The public API's side.

INFO = WorkerDescription(model_name="m", dtype="float32", block_size=16, max_model_len=64, vocab_size=VOCAB_SIZE,
                         num_kv_blocks=8, device="cpu", eos_token_ids=(0,))


def params_of(**request) -> SamplingParams:
    return request_conversion.sampling_params(generate_pb2.GenerateRequest(text="hi", **request), 2, INFO)


def test_the_request_conversion_reads_every_kind_of_constraint() -> None:
    kinds = {"json_schema": '{"type": "integer"}', "regex": "[0-9]+", "grammar": 'start: "x"'}
    for kind, value in kinds.items():
        assert params_of(constraint=generate_pb2.Constraint(**{kind: value})).constraint == Constraint(kind, value)
    assert params_of(constraint=generate_pb2.Constraint(json_object=True)).constraint == Constraint("json_object")
    assert params_of(constraint=generate_pb2.Constraint(json_object=False)).constraint is None
    assert params_of(constraint=generate_pb2.Constraint(choice=generate_pb2.Choices(choices=["a", "b"]))).constraint \
        == Constraint("choice", ("a", "b"))
    assert params_of().constraint is None


@pytest.mark.parametrize(("constraint", "message"), [
    (generate_pb2.Constraint(), "constraint: set one of json_schema, json_object, regex, grammar or choice"),
    (generate_pb2.Constraint(regex=""), "constraint.regex: must not be empty"),
    (generate_pb2.Constraint(json_schema="{"), "constraint.json_schema: not valid JSON"),
    (generate_pb2.Constraint(json_schema="[1]"), "constraint.json_schema: must be a JSON object"),
    (generate_pb2.Constraint(choice=generate_pb2.Choices()), "constraint.choice.choices: must list at least one"),
    (generate_pb2.Constraint(grammar="x" * (MAX_CONSTRAINT_BYTES + 1)),
     f"constraint.grammar: at most {MAX_CONSTRAINT_BYTES} bytes"),
])
def test_the_request_conversion_refuses_bad_constraints_by_field(constraint, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        params_of(constraint=constraint)
    assert str(caught.value).startswith(message)


def test_model_info_reports_the_constraint_limits() -> None:
    info = model_info_response(INFO, object(), "m", has_constraints=True, max_grammar_compile_ms=1234)
    assert (info.has_constraints, info.max_grammar_compile_ms, info.max_constraint_bytes) == (
        True, 1234, MAX_CONSTRAINT_BYTES)


def test_each_of_n_samples_follows_the_constraint_on_its_own(tokenizer) -> None:
    async def scenario() -> dict[int, str]:
        engine = await started(MaskedWorker(tokenizer.eos_token_id), tokenizer)
        texts: dict[int, str] = {}
        try:
            params = SamplingParams(n=3, max_tokens=50, constraint=Constraint("regex", "(ab|cd|ef){4}"))
            async for output in engine.generate([3, 4, 5], params):
                texts[output.index] = texts.get(output.index, "") + output.text
            return texts
        finally:
            await engine.shutdown(0)

    texts = run(scenario())
    assert sorted(texts) == [0, 1, 2] and all(re.fullmatch("(ab|cd|ef){4}", text) for text in texts.values())
    assert len(set(texts.values())) > 1  # each sample has its own matcher (the worker samples at random)
