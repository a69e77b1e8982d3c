"""The public gRPC server over a real socket, against a FakeEngine: round trips, the error table,
health, cancellation and reflection (the real grpcurl binary in test_public_server_grpcurl.py)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from common.client import GenerationClient
from common.generated.nanovllm.generate.v1 import generate_pb2
from scheduler_service.api.public_server import SERVICE_NAME
from scheduler_service.api.tokenizer import load_tokenizer
from tests.scheduler_service.public_server_harness import EOS_ID, FakeEngine, ServerThread, save_tiny_tokenizer
from tests.services_harness import wait_until

MAX_MODEL_LEN = 32
VOCAB_SIZE = 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[ServerThread]:
    thread = ServerThread(FakeEngine(tokenizer, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE)).start()
    yield thread
    thread.stop()


@pytest.fixture
def engine(server: ServerThread, tokenizer) -> Iterator[FakeEngine]:
    """The module's engine, reset to a healthy state after each test."""
    engine = server.engine
    model_info = engine.model_info
    yield engine
    engine.ready, engine.queue_full, engine.crash, engine.hang_after_first_output = True, False, False, False
    engine.tokenizer, engine.model_info = tokenizer, model_info


@pytest.fixture
def client(server: ServerThread) -> Iterator[GenerationClient]:
    with GenerationClient(server.target, timeout=10) as client:
        client.wait_ready(timeout=5)
        yield client


def test_generate_round_trip(client: GenerationClient, engine: FakeEngine, tokenizer) -> None:
    result = client.generate("hello world", request_id="req-1", temperature=0.7, top_k=5, max_tokens=4,
                             stop=["mat"], logprobs=True, top_logprobs=2, seed=3)
    assert (result.request_id, result.text, result.token_ids) == ("req-1", "hello world", [6, 7, EOS_ID])
    assert (result.finish_reason, result.matched_stop) == ("stop", EOS_ID)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens) == (2, 3, 2)
    assert [entry.token_id for entry in result.logprobs] == [6, 7, EOS_ID]
    assert result.logprobs[0].logprob == -0.5 and result.logprobs[0].top_logprobs == ((6, -0.5), (8, -3.0))
    prompt, params = engine.requests[-1]
    assert prompt == tokenizer.encode("hello world")
    assert (params.temperature, params.top_k, params.max_tokens, params.seed) == (0.7, 5, 4, 3)
    assert params.stop == ("mat",) and params.logprobs and params.num_top_logprobs == 2


def test_stream_round_trip(client: GenerationClient) -> None:
    deltas = list(client.stream([6, 7, 8], request_id="req-2"))
    assert "".join(d.text for d in deltas) == "hello world"
    assert [d.token_ids for d in deltas] == [[6], [7], [EOS_ID]]
    assert all(d.request_id == "req-2" for d in deltas)
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]
    assert [d.usage is None for d in deltas] == [True, True, False]
    assert deltas[-1].matched_stop == EOS_ID and deltas[-1].usage.prompt_tokens == 3
    assert all(not d.logprobs for d in deltas)


def test_defaults(client: GenerationClient, engine: FakeEngine) -> None:
    result = client.generate([6, 7, 8])
    assert len(result.request_id) == 32  # assigned by the server
    _, params = engine.requests[-1]
    assert params.max_tokens == MAX_MODEL_LEN - 3  # the room the context leaves
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, -1, 1.0, None)
    assert not params.logprobs and not params.ignore_eos and params.stop == ()


def test_chat_prompt_applies_the_template(client: GenerationClient, engine: FakeEngine, tokenizer) -> None:
    messages = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello"}]
    client.generate(messages=messages, max_tokens=2)
    expected = tokenizer.encode("<|system|> the cat <|user|> hello <|assistant|>", add_special_tokens=False)
    assert engine.requests[-1][0] == expected
    assert client.tokenize(messages=messages) == expected


def test_tokenize_detokenize_model_info(client: GenerationClient) -> None:
    assert client.tokenize("the cat sat") == [8, 9, 10]
    assert client.detokenize([8, 9, EOS_ID]) == "the cat <|eos|>"
    assert client.detokenize([8, 9, EOS_ID], skip_special_tokens=True) == "the cat"
    info = client.model_info()
    assert (info.model_name, info.max_model_len, info.vocab_size, list(info.eos_token_ids)) == (
        "fake-model", MAX_MODEL_LEN, VOCAB_SIZE, [EOS_ID])
    assert info.has_tokenizer and info.has_chat_template and info.max_stop_strings == 16


TOO_LONG = [6] * MAX_MODEL_LEN
INVALID_REQUESTS = [
    # (prompt, messages, sampling, the start of the error message)
    ("", None, {}, "text: must not be empty"),
    ([], None, {}, "token_ids: must not be empty"),
    (None, [], {}, "chat.messages: must not be empty"),
    (TOO_LONG, None, {}, f"prompt: {MAX_MODEL_LEN} tokens, the limit is {MAX_MODEL_LEN - 1}"),
    ([6] * 10, None, {"max_tokens": MAX_MODEL_LEN - 9}, f"max_tokens: 23 + 10 prompt tokens exceed max_model_len "
                                                        f"{MAX_MODEL_LEN} (at most 22)"),
    ([6], None, {"max_tokens": 0}, "max_tokens: must be >= 1"),
    ("hello", None, {"temperature": -0.5}, "temperature: must be >= 0, got -0.5"),
    ("hello", None, {"top_p": 0.0}, "top_p: must be in (0, 1], got 0.0"),
    ("hello", None, {"top_p": 1.5}, "top_p: must be in (0, 1], got 1.5"),
    ("hello", None, {"top_k": 0}, "top_k: must be -1 (all) or >= 1, got 0"),
    ("hello", None, {"top_k": -2}, "top_k: must be -1 (all) or >= 1, got -2"),
    ("hello", None, {"min_p": 1.5}, "min_p: must be in [0, 1]"),
    ("hello", None, {"repetition_penalty": 0.0}, "repetition_penalty: must be > 0"),
    ("hello", None, {"frequency_penalty": 3.0}, "frequency_penalty: must be in [-2, 2]"),
    ("hello", None, {"seed": 2**63}, "seed: must be in [0, 2^63)"),
    ("hello", None, {"temperature": float("inf")}, "temperature: must be a finite number, got inf"),
    ("hello", None, {"temperature": float("nan")}, "temperature: must be a finite number, got nan"),
    ("hello", None, {"top_p": float("nan")}, "top_p: must be a finite number, got nan"),
    ("hello", None, {"repetition_penalty": float("inf")}, "repetition_penalty: must be a finite number, got inf"),
    ("hello", None, {"presence_penalty": float("-inf")}, "presence_penalty: must be a finite number, got -inf"),
    ([6, VOCAB_SIZE], None, {}, f"token_ids: token id {VOCAB_SIZE} at index 1 is outside the vocabulary "
                                f"[0, {VOCAB_SIZE})"),
    ([-1], None, {}, "token_ids: token id -1 at index 0 is outside the vocabulary"),
    ("hello", None, {"stop_token_ids": [99]}, "stop_token_ids: token id 99 at index 0 is outside the vocabulary"),
    ("hello", None, {"stop": [f"s{i}" for i in range(17)]}, "stop: at most 16 stop strings, got 17"),
    ("hello", None, {"stop": [""]}, "stop: each stop string must have 1..256 characters"),
    ("hello", None, {"top_logprobs": 21}, "top_logprobs: must be in [0, 20], got 21"),
    ("hello", None, {"top_logprobs": 2}, "top_logprobs: needs logprobs: true (got 2 with logprobs: false)"),
    ("hello", None, {"top_logprobs": 2, "logprobs": False}, "top_logprobs: needs logprobs: true"),
    (None, [{"role": "bot", "content": "hi"}], {},
     "chat.messages[0].role: must be one of system, user, assistant, tool; got 'bot'"),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("prompt", "messages", "sampling", "message"), INVALID_REQUESTS,
                         ids=[case[3].split(":")[0] + f"-{i}" for i, case in enumerate(INVALID_REQUESTS)])
def test_invalid_requests(client: GenerationClient, engine: FakeEngine, streaming: bool, prompt, messages,
                          sampling: dict, message: str) -> None:
    num_requests = len(engine.requests)
    with pytest.raises(grpc.RpcError) as error:
        if streaming:
            list(client.stream(prompt, messages=messages, **sampling))
        else:
            client.generate(prompt, messages=messages, **sampling)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(message), error.value.details()
    assert len(engine.requests) == num_requests  # rejected before reaching the engine
    assert client.health_status() == "SERVING" and client.generate([6]).text == "hello world"


def test_text_too_long_for_the_context_is_refused_untokenized(client: GenerationClient, engine: FakeEngine,
                                                              tokenizer) -> None:
    limit = 2 * MAX_MODEL_LEN * tokenizer.max_token_bytes  # bytes no MAX_MODEL_LEN tokens could stand for
    text = "the cat " * (limit // 8 + 1)
    calls = [("text", lambda: client.generate(text)),
             ("chat.messages", lambda: client.generate(messages=[("user", text)])),
             ("text", lambda: client.tokenize(text))]  # Tokenize too, once the model's context is known
    for field, call in calls:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == (f"{field}: {len(text)} bytes of text cannot fit {MAX_MODEL_LEN} "
                                         f"tokens (max_model_len; at most {limit} bytes)")
    # Just under the bound it is tokenized, and then the token count decides.
    shorter = text[:limit]
    assert len(client.tokenize(shorter)) >= MAX_MODEL_LEN
    with pytest.raises(grpc.RpcError) as error:
        client.generate(shorter)
    assert error.value.details().startswith("prompt: ")
    engine.model_info = None  # before any worker connected: no context to judge by
    assert len(client.tokenize(text)) > MAX_MODEL_LEN


def test_missing_prompt(client: GenerationClient) -> None:
    with pytest.raises(grpc.RpcError) as error:
        client.stub.Generate(generate_pb2.GenerateRequest(max_tokens=4))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "prompt: set one of text, token_ids or chat"


def test_without_chat_template_or_tokenizer(client: GenerationClient, engine: FakeEngine, tmp_path) -> None:
    engine.tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path, with_chat_template=False)))
    with pytest.raises(grpc.RpcError) as error:
        client.generate(messages=[("user", "hello")])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("chat: this model's tokenizer has no chat template")
    engine.tokenizer = None
    for call in (lambda: client.generate("hello"), lambda: client.tokenize("hello"),
                 lambda: client.detokenize([6])):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "this model has no tokenizer" in error.value.details()
    assert client.generate([6]).token_ids == [6, 7, EOS_ID]  # token ids still work
    assert not client.model_info().has_tokenizer


@pytest.mark.parametrize(("flag", "code", "details"), [
    ("queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue: full (4 requests)"),
    ("crash", grpc.StatusCode.INTERNAL, "internal error (RuntimeError); see the server log"),
])
def test_engine_errors(client: GenerationClient, engine: FakeEngine, flag: str, code, details: str) -> None:
    setattr(engine, flag, True)
    for call in (lambda: client.generate("hello"), lambda: list(client.stream("hello"))):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert (error.value.code(), error.value.details()) == (code, details)
    setattr(engine, flag, False)
    assert client.generate("hello").text == "hello world"


def test_unavailable_while_not_ready(client: GenerationClient, engine: FakeEngine) -> None:
    engine.ready = False
    for call in (lambda: client.generate("hello"), lambda: list(client.stream("hello"))):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: client.health_status() == "NOT_SERVING", 5.0, "health NOT_SERVING")
    engine.ready = True
    client.wait_ready(timeout=5)


def test_unavailable_before_any_worker_connected(client: GenerationClient, engine: FakeEngine) -> None:
    """As the real engine right after start: no worker has said what it serves (no model info)."""
    engine.ready, engine.model_info = False, None
    calls = [lambda: client.generate("hello"), lambda: list(client.stream([6, 7])),
             lambda: client.detokenize([6]), lambda: client.model_info()]
    for call in calls:
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.UNAVAILABLE, "no worker is ready")
    assert client.tokenize("the cat") == [8, 9]  # the scheduler's own tokenizer needs no worker


def test_health_not_serving_then_serving_then_draining(tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.ready = False
    server = ServerThread(engine).start()
    try:
        with GenerationClient(server.target, timeout=5) as client:
            assert client.health_status() == client.health_status(SERVICE_NAME) == "NOT_SERVING"
            with pytest.raises(TimeoutError, match="NOT_SERVING"):
                client.wait_ready(timeout=0.2)
            watch = client.health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            engine.ready = True
            client.wait_ready(timeout=5)
            assert client.health_status(SERVICE_NAME) == "SERVING"
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            server.run(server.public.set_not_serving())
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            assert client.health_status() == client.health_status(SERVICE_NAME) == "NOT_SERVING"
            time.sleep(0.1)  # the readiness watcher must not flip it back
            assert client.health_status() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as error:
                client.health_status("no.such.Service")
            assert error.value.code() == grpc.StatusCode.NOT_FOUND  # health's own status passes through
    finally:
        server.stop()


def test_cancelled_stream_closes_the_engine_request(client: GenerationClient, engine: FakeEngine) -> None:
    engine.hang_after_first_output = True
    num_closed = engine.num_closed
    stream = client.stream("hello")
    assert next(stream).text == "hello"
    stream.close()  # cancels the call
    wait_until(lambda: engine.num_closed == num_closed + 1, 5.0, "the generator closed")


def test_deadline_closes_the_engine_request(client: GenerationClient, engine: FakeEngine) -> None:
    engine.hang_after_first_output = True
    num_closed = engine.num_closed
    with pytest.raises(grpc.RpcError) as error:
        client.generate("hello", timeout=0.3)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine.num_closed == num_closed + 1, 5.0, "the generator closed")


def test_reflection_lists_the_services(server: ServerThread) -> None:
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
        file = database.FindFileContainingSymbol(SERVICE_NAME)
        assert file.package == "nanovllm.generate.v1"
