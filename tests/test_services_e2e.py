"""End to end over real sockets: worker and scheduler started by the `nanovllm` CLI as separate
processes (or the scheduler in this process where a test reads its block counts), called through
the Python client; compared with the offline LLM on the same checkpoint."""
from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common import SamplingParams
from common.client import GenerationClient
from offline import LLM
from tests.services_harness import (
    InProcessScheduler,
    free_port,
    run_cli,
    start_scheduler,
    start_worker,
    stop,
    wait_until,
    worker_describe,
)
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "Ça coûte combien?",
    "def main():",
    "日本語のテキスト",
    "Numbers 0123",
]
MAX_TOKENS = 24
LONG_MAX_TOKENS = 400


def model_with_tokenizer(folder: Path, **shape) -> Path:
    path = make_tiny_checkpoint(folder, "qwen3", **shape)
    save_tiny_bpe_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return model_with_tokenizer(tmp_path_factory.mktemp("small"), num_heads=4, num_kv_heads=2, head_dim=16,
                                hidden_size=64)


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    """Big enough that a long generation takes seconds on a CPU, so that tests can act mid-stream."""
    return model_with_tokenizer(tmp_path_factory.mktemp("slow"), num_heads=8, num_kv_heads=4, head_dim=64,
                                hidden_size=512, intermediate_size=2048, num_layers=8,
                                max_position_embeddings=1024)


@pytest.fixture(scope="module")
def offline(small_model: Path) -> list[dict]:
    llm = LLM(str(small_model), block_size=16, num_kv_blocks=256, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def services(small_model: Path):
    """Worker and scheduler as separate processes, started as a user starts them."""
    worker_port, port = free_port(), free_port()
    worker = start_worker(small_model, worker_port)
    scheduler = start_scheduler(worker_port, port)
    client = GenerationClient(f"127.0.0.1:{port}", timeout=60)
    try:
        client.wait_ready(timeout=120)
        yield client
    finally:
        client.close()
        stop(scheduler)
        stop(worker)


def test_generate_and_stream_equal_offline(services: GenerationClient, offline: list[dict]) -> None:
    for prompt, expected in zip(PROMPTS, offline, strict=True):
        result = services.generate(prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert result.token_ids == expected["token_ids"]
        assert result.text == expected["text"]
        assert result.finish_reason == "length"
        deltas = list(services.stream(prompt, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [t for d in deltas for t in d.token_ids] == expected["token_ids"]
        assert "".join(d.text for d in deltas) == expected["text"]
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].usage.completion_tokens == MAX_TOKENS


def test_32_concurrent_streams_complete_correctly(services: GenerationClient, offline: list[dict]) -> None:
    def run(index: int) -> tuple[int, list[int], str]:
        deltas = list(services.stream(PROMPTS[index % len(PROMPTS)], temperature=0, max_tokens=MAX_TOKENS,
                                      ignore_eos=True))
        return index, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    for index, token_ids, text in results:
        expected = offline[index % len(PROMPTS)]
        assert (token_ids, text) == (expected["token_ids"], expected["text"])


def test_health_command_sees_the_scheduler_serving(services: GenerationClient) -> None:
    result = run_cli("health", "--target", services.target)
    assert result.returncode == 0 and result.stdout.strip().endswith("SERVING")


def test_invalid_request_leaves_the_service_healthy(services: GenerationClient) -> None:
    with pytest.raises(grpc.RpcError) as error:
        services.generate("hello", max_tokens=10_000)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in error.value.details()
    assert services.health_status() == "SERVING"
    assert services.generate("hello", max_tokens=2).usage.completion_tokens >= 1


@pytest.fixture
def slow_worker(slow_model: Path):
    port = free_port()
    worker = start_worker(slow_model, port)
    yield port, worker
    stop(worker)


@pytest.fixture
def in_process(slow_model: Path, slow_worker):
    scheduler = InProcessScheduler(slow_model, slow_worker[0]).start()
    client = GenerationClient(scheduler.target, timeout=120)
    client.wait_ready(timeout=120)
    yield scheduler, client
    client.close()
    scheduler.stop()


def assert_everything_released(scheduler: InProcessScheduler, worker_port: int) -> None:
    engine = scheduler.engine
    assert engine is not None
    wait_until(lambda: engine.num_unfinished == 0 and all(stats.num_free_kv_blocks == stats.num_kv_blocks
                                                          for _, stats in engine.worker_stats()),
               timeout=10, what="all KV blocks back in the pool")
    wait_until(lambda: worker_describe(worker_port).num_held_sequences == 0, timeout=10,
               what="the worker to release the sequence")


def test_cancelled_stream_frees_its_blocks_at_once(in_process, slow_worker) -> None:
    scheduler, client = in_process
    stream = client.stream("The quick brown fox", temperature=0, max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    received = [next(stream) for _ in range(3)]
    ((_, stats),) = scheduler.engine.worker_stats()
    assert stats.num_free_kv_blocks < stats.num_kv_blocks
    stream.close()  # cancels the call
    assert sum(len(d.token_ids) for d in received) < LONG_MAX_TOKENS
    assert_everything_released(scheduler, slow_worker[0])


def test_expired_deadline_frees_its_blocks(in_process, slow_worker) -> None:
    scheduler, client = in_process
    with pytest.raises(grpc.RpcError) as error:
        list(client.stream("The quick brown fox", temperature=0, max_tokens=LONG_MAX_TOKENS, ignore_eos=True,
                           timeout=0.5))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_everything_released(scheduler, slow_worker[0])


def test_killed_worker_loses_no_request(in_process, slow_worker, slow_model: Path) -> None:
    scheduler, client = in_process
    port, worker = slow_worker
    expected = LLM(str(slow_model), block_size=16, num_kv_blocks=256, device="cpu").generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)[0]
    stream = client.stream("The quick brown fox", temperature=0, max_tokens=60, ignore_eos=True)
    deltas = [next(stream) for _ in range(3)]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert sum(len(d.token_ids) for d in deltas) < 60
    restarted = start_worker(slow_model, port)
    try:
        deltas += list(stream)
        assert [t for d in deltas for t in d.token_ids] == expected["token_ids"]
        assert "".join(d.text for d in deltas) == expected["text"]
        assert deltas[-1].finish_reason == "length"
    finally:
        stop(restarted)


def test_sigterm_drains_then_exits(slow_model: Path, slow_worker) -> None:
    port = free_port()
    scheduler = start_scheduler(slow_worker[0], port, "--shutdown-grace", "60")
    client = GenerationClient(f"127.0.0.1:{port}", timeout=120)
    try:
        client.wait_ready(timeout=120)
        stream = client.stream("The quick brown fox", temperature=0, max_tokens=80, ignore_eos=True)
        deltas = [next(stream)]
        scheduler.send_signal(signal.SIGTERM)
        wait_until(lambda: client.health_status() == "NOT_SERVING", timeout=10, what="NOT_SERVING")
        with pytest.raises(grpc.RpcError) as error:
            client.generate("hello", max_tokens=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        deltas += list(stream)
        assert sum(len(d.token_ids) for d in deltas) == 80
        assert deltas[-1].finish_reason == "length"
        assert scheduler.wait(timeout=30) == 0
    finally:
        client.close()
        stop(scheduler)


def test_stop_string_split_across_tokens_over_grpc(services: GenerationClient, offline: list[dict],
                                                   small_model: Path) -> None:
    """A stop string taken from the middle of a known output, spanning a token boundary: the
    stream ends right before it, and no delta ever carried any of it."""
    from scheduler_service.api.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(small_model))
    expected = offline[0]
    pieces = [tokenizer.decode(expected["token_ids"][:n]) for n in range(len(expected["token_ids"]) + 1)]
    # The text of tokens 4..5 plus the first character of token 6: it crosses two token boundaries.
    start, end = len(pieces[4]), len(pieces[6]) + 1
    stop_string = expected["text"][start:end]
    assert len(stop_string) >= 2 and "\ufffd" not in stop_string
    first = expected["text"].index(stop_string)
    deltas = list(services.stream(PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  stop=[stop_string]))
    text = "".join(d.text for d in deltas)
    assert text == expected["text"][:first]
    assert deltas[-1].finish_reason == "stop_sequence" and deltas[-1].matched_stop == stop_string
    streamed = ""
    for delta in deltas[:-1]:  # a possible start of the stop string is held back, never sent
        streamed += delta.text
        assert stop_string not in streamed
        assert not any(streamed.endswith(stop_string[:n]) for n in range(1, len(stop_string)))


def test_logprobs_over_grpc_equal_transformers(services: GenerationClient, small_model: Path) -> None:
    """Greedy tokens with their log-probabilities and top-3 alternatives, against the log-softmax
    of transformers' logits on the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from scheduler_service.api.tokenizer import load_tokenizer

    result = services.generate(PROMPTS[1], temperature=0, max_tokens=12, ignore_eos=True, logprobs=True,
                               top_logprobs=3)
    prompt = load_tokenizer(str(small_model)).encode(PROMPTS[1])
    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1:-1]
    reference = torch.log_softmax(logits, dim=-1)
    assert len(result.logprobs) == len(result.token_ids) == 12
    for position, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[position]
        assert entry.logprob == pytest.approx(reference[position, entry.token_id].item(), abs=1e-4)
        top = reference[position].topk(3)
        assert [token for token, _ in entry.top_logprobs] == top.indices.tolist()
        assert [value for _, value in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
