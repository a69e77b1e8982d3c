"""Only documented status codes leave the public port: unparsable bodies and long values get a
short INVALID_ARGUMENT (no traceback in the log), a burst of calls far beyond the queue gets
success or RESOURCE_EXHAUSTED and never CANCELLED, and a second server cannot share the port."""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from common.client import GenerationClient
from common.contract.config import PublicServerConfig
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from common.net import grpc_options
from scheduler_service.api.public_server import SERVICE_NAME, PortInUseError, build_public_server
from scheduler_service.api.tokenizer import load_tokenizer
from scheduler_service.core.errors import QueueFullError
from scheduler_service.core.outputs import RequestOutput
from tests.loop_thread import LoopThread
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer
from tests.services_harness import run_cli

MALFORMED_MESSAGE = ("request: not a valid protobuf message of this method's request type (or a string field is "
                     "not UTF-8)")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[ServerThread]:
    thread = ServerThread(FakeEngine(tokenizer)).start()
    yield thread
    thread.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[GenerationClient]:
    with GenerationClient(server.target, timeout=10) as client:
        client.wait_ready(timeout=5)
        yield client


def raw_call(client: GenerationClient, method: str, body: bytes, streaming: bool) -> grpc.RpcError:
    """Sends `body` as is, without protobuf serialization."""
    path = f"/{SERVICE_NAME}/{method}"
    if streaming:
        call = client.channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as raised:
            list(call(body, timeout=10))
    else:
        call = client.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as raised:
            call(body, timeout=10)
    return raised.value


# Field 2 (text) with a length of 2 and the bytes 0xff 0xfe: protobuf-valid framing, not UTF-8.
INVALID_UTF8_TEXT = b"\x12\x02\xff\xfe"
NOT_PROTOBUF = b"\xff\xff\xff\xff\xff"


@pytest.mark.parametrize(("method", "streaming"), [("Generate", False), ("GenerateStream", True),
                                                   ("Tokenize", False)])
@pytest.mark.parametrize("body", [NOT_PROTOBUF, INVALID_UTF8_TEXT], ids=["not-protobuf", "invalid-utf8"])
def test_unparsable_bodies_are_invalid_argument_without_a_traceback(
        client: GenerationClient, caplog: pytest.LogCaptureFixture, method: str, streaming: bool, body: bytes) -> None:
    caplog.set_level(logging.DEBUG)
    error = raw_call(client, method, body, streaming)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, MALFORMED_MESSAGE)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert client.generate("hello").text == "hello world"


def test_request_id_at_most_256_bytes(client: GenerationClient) -> None:
    assert client.generate("hello", request_id="é" * 128).request_id == "é" * 128  # 256 bytes
    with pytest.raises(grpc.RpcError) as raised:
        client.generate("hello", request_id="x" * 1_000_000)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "request_id: at most 256 bytes, got 1000000"


@pytest.mark.parametrize(("kwargs", "start"), [
    ({"stop": ["x" * 100_000]}, "stop: each stop string must have 1..256 characters, got 'xxxx"),
    ({"messages": [{"role": "r" * 100_000, "content": "hi"}]}, "chat.messages[0].role: must be one of"),
])
def test_long_values_are_quoted_short(client: GenerationClient, kwargs: dict, start: str) -> None:
    """A message echoing a 100 kB value would overflow grpc's 16 KiB trailer limit: the client saw
    RESOURCE_EXHAUSTED "Stream removed" instead of the error."""
    prompt = None if "messages" in kwargs else "hello"
    with pytest.raises(grpc.RpcError) as raised:
        client.generate(prompt, **kwargs)
    details = raised.value.details()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(start) and details.endswith("... (100000 characters)") and len(details) < 320


class AdmitsEight(FakeEngine):
    """Holds up to 8 requests and refuses the others (QueueFullError, as the engine's full queue);
    lets the held ones finish once `num_refusals_to_release` calls were refused."""

    def __init__(self, tokenizer, num_refusals_to_release: int) -> None:
        super().__init__(tokenizer)
        self.num_held = 0
        self.num_refused = 0
        self.num_refusals_to_release = num_refusals_to_release
        self.release = asyncio.Event()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.num_held >= 8:
            self.num_refused += 1
            if self.num_refused == self.num_refusals_to_release:
                self.release.set()
            raise QueueFullError("queue: full (8 requests)")
        self.num_held += 1
        await self.release.wait()
        async for output in super().generate(prompt_token_ids, params):
            yield output


@pytest.mark.slow
def test_5000_concurrent_calls_end_in_success_or_resource_exhausted(tokenizer) -> None:
    """grpcio cancelled 2,116 of 5,000 such calls (its pending-call limits) before any reached the
    queue limit; now every call but the 8 held ones reaches the engine and is refused by name."""
    num_calls = 5000
    engine = AdmitsEight(tokenizer, num_refusals_to_release=num_calls - 8)
    server = ServerThread(engine)
    server.run_timeout = 120.0
    server.start()

    async def call_all() -> collections.Counter:
        async with grpc.aio.insecure_channel(server.target, options=grpc_options.channel_options()) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)

            async def one(index: int) -> str:
                request = generate_pb2.GenerateRequest(text="hello world", max_tokens=4)
                try:
                    if index % 2:
                        await stub.Generate(request, timeout=120)
                    else:
                        [message async for message in stub.GenerateStream(request, timeout=120)]
                    return "OK"
                except grpc.aio.AioRpcError as error:
                    return f"{error.code().name}: {error.details()}"

            return collections.Counter(await asyncio.gather(*(one(index) for index in range(num_calls))))

    try:
        counts = asyncio.run(call_all())
    finally:
        server.stop()
    assert counts == {"OK": 8, "RESOURCE_EXHAUSTED: queue: full (8 requests)": num_calls - 8}


def test_calls_beyond_max_concurrent_calls_get_resource_exhausted(tokenizer) -> None:
    engine = FakeEngine(tokenizer)
    engine.hang_after_first_output = True
    server = ServerThread(engine, config=PublicServerConfig(max_concurrent_calls=2)).start()
    try:
        with GenerationClient(server.target, timeout=10) as client:
            streams = [client.stream("hello") for _ in range(2)]
            assert [next(stream).text for stream in streams] == ["hello", "hello"]  # both admitted and held
            with pytest.raises(grpc.RpcError) as raised:
                client.generate("hello")
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert raised.value.details() == "server: 2 calls in progress, the limit (--max-concurrent-calls)"
            assert client.health_status() == "SERVING"  # probes pass the limit
            for stream in streams:
                stream.close()
    finally:
        server.stop()


def test_a_second_server_on_the_port_fails_to_bind(server: ServerThread, tokenizer) -> None:
    loop = LoopThread("second-server")

    async def build() -> None:
        build_public_server(FakeEngine(tokenizer), "127.0.0.1", server.public.port)

    try:
        with pytest.raises(PortInUseError, match=f"public port 127.0.0.1:{server.public.port} is in use"):
            loop.run(build())
    finally:
        loop.close()


def test_the_scheduler_exits_with_one_line_naming_a_port_in_use(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--log-level", "WARNING", "scheduler", "--worker", "127.0.0.1:1", "--port", str(port),
                         "--tokenizer", str(save_tiny_tokenizer(tmp_path / "tokenizer")), timeout=60)
    assert result.returncode == 1
    assert result.stderr == f"nanovllm scheduler: public port 127.0.0.1:{port} is in use by another process\n"


def test_an_unparsable_reflection_request_is_invalid_argument(client: GenerationClient) -> None:
    call = client.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                        request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as raised:
        list(call(iter([NOT_PROTOBUF]), timeout=10))
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, MALFORMED_MESSAGE)
