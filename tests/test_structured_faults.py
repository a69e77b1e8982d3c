"""Structured output, parallel samples and seeded sampling through a worker's loss: kill -9 the
worker while a constrained stream, an n = 3 seeded stream and a constrained seeded stream run; a
new worker comes up; every request completes with every sample, each equal to its undisturbed
run token for token (CPU, float32: a recompute gives the same logits), and the constrained ones
still match their constraint (the scheduler's matcher resumes from the tokens it holds; with the worker
advancing the grammars, the new worker's matchers from the output tokens each NewSequence lists), with
either --grammar-masks."""
from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.client import GenerationClient
from common.contract.config import SchedulerConfig
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from tests.services_harness import InProcessScheduler, free_port, start_worker, stop
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

REGEX = "[a-z ]+"
# At least 30 integers: more than MAX_TOKENS tokens, so the output is cut (LENGTH) mid-array.
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 30}
MAX_TOKENS = 48


def requests() -> dict[str, generate_pb2.GenerateRequest]:
    return {
        "regex_greedy": generate_pb2.GenerateRequest(
            text="The quick brown fox", max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0,
            constraint=generate_pb2.Constraint(regex=REGEX)),
        "n3_seeded": generate_pb2.GenerateRequest(
            text="def main():", max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=3, ignore_eos=True),
        "schema_seeded": generate_pb2.GenerateRequest(
            text="Numbers 0123", max_tokens=MAX_TOKENS, temperature=0.8, seed=11,
            constraint=generate_pb2.Constraint(json_schema=json.dumps(SCHEMA))),
    }


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    """Slow enough on a CPU that the streams are mid-way when the worker is killed."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("slow"), "qwen3", num_heads=8, num_kv_heads=4, head_dim=64,
                                hidden_size=512, intermediate_size=2048, num_layers=8, max_position_embeddings=1024)
    save_tiny_bpe_tokenizer(path)
    return path


def samples_of(messages) -> dict[int, dict]:
    """Every sample's tokens, text and finish reason, from a stream's messages."""
    samples: dict[int, dict] = {}
    for message in messages:
        sample = samples.setdefault(message.index, {"token_ids": [], "text": "", "finish_reason": 0})
        sample["token_ids"] += list(message.token_ids)
        sample["text"] += message.text
        sample["finish_reason"] = message.finish_reason or sample["finish_reason"]
    return samples


def read_all(calls: dict) -> dict[str, list]:
    """The rest of every stream's messages, read at once."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(list, call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def matches(tokenizer_json: Path, constraint: generate_pb2.Constraint, token_ids: list[int]) -> bool:
    """Whether the grammar library, on its own, accepts every token (a prefix of a match)."""
    from llguidance import LLMatcher, LLTokenizer

    if constraint.HasField("regex"):
        grammar = LLMatcher.grammar_from_regex(constraint.regex)
    else:
        grammar = LLMatcher.grammar_from_json_schema(constraint.json_schema, defaults={"whitespace_flexible": False})
    matcher = LLMatcher(LLTokenizer(str(tokenizer_json)), grammar)
    return matcher.validate_tokens(token_ids) == len(token_ids)


def check(results: dict[str, dict[int, dict]], tokenizer_json: Path) -> None:
    wanted = requests()
    (regex,) = results["regex_greedy"].values()
    assert len(regex["token_ids"]) == MAX_TOKENS and re.fullmatch(REGEX, regex["text"])
    (schema,) = results["schema_seeded"].values()
    assert schema["finish_reason"] == generate_pb2.FINISH_REASON_LENGTH
    for name in ("regex_greedy", "schema_seeded"):
        (sample,) = results[name].values()
        assert matches(tokenizer_json, wanted[name].constraint, sample["token_ids"]), name
    assert sorted(results["n3_seeded"]) == [0, 1, 2]
    assert all(len(s["token_ids"]) == MAX_TOKENS for s in results["n3_seeded"].values())
    assert len({tuple(s["token_ids"]) for s in results["n3_seeded"].values()}) == 3  # each its own seed stream


@pytest.mark.parametrize("grammar_masks", ["worker", "scheduler"])
def test_constrained_and_parallel_requests_survive_a_killed_worker(slow_model: Path, grammar_masks: str) -> None:
    port = free_port()
    worker = start_worker(slow_model, port)
    scheduler = InProcessScheduler(slow_model, port, SchedulerConfig(grammar_masks=grammar_masks)).start()
    try:
        with GenerationClient(scheduler.target) as client:
            client.wait_ready(timeout=120)
        assert scheduler.engine.lanes[0].core.grammars_on_worker == (grammar_masks == "worker")
        with grpc.insecure_channel(scheduler.target) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            calls = {name: stub.GenerateStream(request, timeout=300) for name, request in requests().items()}
            undisturbed = {name: samples_of(messages) for name, messages in read_all(calls).items()}
            check(undisturbed, slow_model / "tokenizer.json")

            calls = {name: stub.GenerateStream(request, timeout=300) for name, request in requests().items()}
            first = {name: next(call) for name, call in calls.items()}  # every request is under way
            worker.send_signal(signal.SIGKILL)
            worker.wait()
            assert not any(message.finish_reason for message in first.values())
            worker = start_worker(slow_model, port)
            rest = read_all(calls)
        disturbed = {name: samples_of([first[name], *rest[name]]) for name in calls}
        assert disturbed == undisturbed
    finally:
        scheduler.stop()
        stop(worker)
