"""Metrics, GetLoad and request logs of the real services: worker and scheduler processes started
by the `nanovllm` CLI, called over gRPC, /metrics scraped over HTTP after the requests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.client import GenerationClient, build_request
from common.generated.nanovllm.generate.v1 import generate_pb2, generate_pb2_grpc
from common.security.worker_secret import SECRET_ENV
from tests.metrics_scrape import scrape, value
from tests.services_harness import REPO_ROOT, WORKER_SECRET, cli, free_port, stop, wait_until
from tests.test_services_e2e import model_with_tokenizer

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SECRET_PROMPT = "Tell nobody: the cat sat on the mat"


class Services:
    """Workers and a scheduler with --metrics-port and JSON logs (its stderr in a file)."""

    def __init__(self, model: Path, log_path: Path, num_workers: int, *worker_options: str) -> None:
        self.worker_ports = [free_port() for _ in range(num_workers)]
        self.workers = [cli("worker", "--model", str(model), "--port", str(port), "--block-size", "16",
                            "--device", "cpu", *worker_options) for port in self.worker_ports]
        self.addresses = [f"127.0.0.1:{port}" for port in self.worker_ports]
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = log_path
        with log_path.open("w") as log:
            self.scheduler = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "--log-format", "json", "scheduler", "--worker",
                 ",".join(self.addresses), "--port", str(self.port), "--metrics-port", str(self.metrics_port)],
                cwd=REPO_ROOT, stderr=log, env={**os.environ, SECRET_ENV: WORKER_SECRET})
        self.client = GenerationClient(f"127.0.0.1:{self.port}", timeout=120)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)

    def wait_ready(self) -> None:
        self.client.wait_ready(timeout=120)
        wait_until(lambda: self.stub.GetLoad(generate_pb2.GetLoadRequest()).num_workers_ready == len(self.workers),
                   timeout=120, what="every worker ready")

    def scrape(self) -> dict:
        return scrape(self.metrics_port)

    def request_lines(self) -> list[dict]:
        lines = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        return [line for line in lines if line["logger"] == "nanovllm.requests"]

    def __enter__(self) -> Services:
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        stop(self.scheduler)
        for worker in self.workers:
            stop(worker)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    folder = tmp_path_factory.mktemp("observability")
    model = model_with_tokenizer(folder, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    with Services(model, folder / "scheduler.log", 2, "--num-kv-blocks", "64") as services:
        yield services


def test_requests_and_tokens_are_counted(two_workers: Services) -> None:
    before = two_workers.scrape()
    results = [two_workers.client.generate(prompt, max_tokens=7 + i, ignore_eos=True, temperature=0)
               for i, prompt in enumerate(["hello", "the cat", "on a mat"])]
    after = two_workers.scrape()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("nanovllm_request_success_total", finish_reason="length") == 3
    assert delta("nanovllm_generation_tokens_total") == 7 + 8 + 9
    assert delta("nanovllm_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert delta("nanovllm_request_prompt_tokens_sum") == sum(r.usage.prompt_tokens for r in results)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"nanovllm_{histogram}_count") == 3
    assert delta("nanovllm_step_duration_seconds_count") >= 3
    assert value(after, "nanovllm_workers_ready") == 2


def test_a_prefix_hit_is_counted_in_tokens(two_workers: Services) -> None:
    prompt = list(range(100, 140))  # two full blocks of 16, and a rest
    before = two_workers.scrape()
    first = two_workers.client.generate(prompt, max_tokens=2, ignore_eos=True)
    second = two_workers.client.generate(prompt, max_tokens=2, ignore_eos=True)  # the same idle lane: a hit
    after = two_workers.scrape()
    assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, 32)
    assert value(after, "nanovllm_prefix_cache_hits_total") - value(before, "nanovllm_prefix_cache_hits_total") == 32
    assert value(after, "nanovllm_prefix_cache_queries_total") - \
        value(before, "nanovllm_prefix_cache_queries_total") == 80


def test_idle_load_per_worker_in_get_load_and_the_gauges(two_workers: Services) -> None:
    reply = two_workers.stub.GetLoad(generate_pb2.GetLoadRequest())
    assert [(w.address, w.ready, w.num_requests_running, w.num_requests_waiting, w.kv_cache_usage,
             w.num_kv_blocks) for w in reply.workers] == [(a, True, 0, 0, 0.0, 64) for a in two_workers.addresses]
    samples = two_workers.scrape()
    for address in two_workers.addresses:
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio"):
            assert (f"nanovllm_{gauge}", frozenset({("worker", address), ("model_name", "qwen3")})) in samples
            assert value(samples, f"nanovllm_{gauge}", worker=address) == 0


def test_one_json_log_line_per_request_with_the_traceparent_and_no_prompt(two_workers: Services) -> None:
    request = build_request(SECRET_PROMPT, request_id="traced-1", max_tokens=5, ignore_eos=True)
    reply = two_workers.stub.Generate(request, metadata=[("traceparent", TRACEPARENT)])
    wait_until(lambda: any(line["request_id"] == "traced-1" for line in two_workers.request_lines()), timeout=10,
               what="the request's log line")
    [line] = [line for line in two_workers.request_lines() if line["request_id"] == "traced-1"]
    assert {k: line[k] for k in ("message", "method", "status", "finish_reason", "prompt_tokens",
                                 "completion_tokens", "cached_tokens", "traceparent")} == {
        "message": "request finished", "method": "Generate", "status": "OK", "finish_reason": "length",
        "prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": 5, "cached_tokens": 0,
        "traceparent": TRACEPARENT}
    assert 0 < line["ttft_s"] <= line["e2e_s"] and line["queue_time_s"] >= 0
    assert SECRET_PROMPT not in two_workers.log_path.read_text() and reply.text not in two_workers.log_path.read_text()


@pytest.fixture(scope="module")
def tight_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    """A slow model (seconds per long generation) and a KV pool of 8 blocks of 16 tokens."""
    folder = tmp_path_factory.mktemp("tight")
    model = model_with_tokenizer(folder, num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=512,
                                 intermediate_size=2048, num_layers=8, max_position_embeddings=1024)
    with Services(model, folder / "scheduler.log", 1, "--num-kv-blocks", "8") as services:
        yield services


def test_running_load_then_a_preemption(tight_pool: Services) -> None:
    address = tight_pool.addresses[0]
    stream = tight_pool.client.stream("The quick brown fox", max_tokens=100, ignore_eos=True, temperature=0)
    deltas = [next(stream)]
    reply = tight_pool.stub.GetLoad(generate_pb2.GetLoadRequest())
    assert (reply.num_requests_running, reply.num_requests_waiting, reply.workers[0].address) == (1, 0, address)
    assert 0 < reply.kv_cache_usage <= 1
    samples = tight_pool.scrape()
    assert value(samples, "nanovllm_num_requests_running", worker=address) == 1
    assert 0 < value(samples, "nanovllm_kv_cache_usage_ratio", worker=address) <= 1
    # A second long request while the first runs: the two need 14 blocks of the 8, so one is
    # preempted and recomputed later; both still finish whole.
    second: list = []
    thread = threading.Thread(target=lambda: second.append(
        tight_pool.client.generate("The quick brown fox", max_tokens=100, ignore_eos=True, temperature=0)))
    thread.start()
    deltas += list(stream)
    thread.join(timeout=120)
    assert sum(len(d.token_ids) for d in deltas) == 100 and len(second[0].token_ids) == 100
    samples = tight_pool.scrape()
    assert value(samples, "nanovllm_num_preemptions_total") >= 1
    assert value(samples, "nanovllm_request_success_total", finish_reason="length") == 2


def test_a_cancelled_stream_is_counted_and_its_blocks_freed(tight_pool: Services) -> None:
    address = tight_pool.addresses[0]
    stream = tight_pool.client.stream("The quick brown fox", max_tokens=100, ignore_eos=True)
    next(stream)
    stream.close()  # cancels the call
    wait_until(lambda: value(tight_pool.scrape(), "nanovllm_request_failure_total", code="CANCELLED") == 1,
               timeout=30, what="the cancelled request counted")
    wait_until(lambda: value(tight_pool.scrape(), "nanovllm_kv_cache_usage_ratio", worker=address) == 0,
               timeout=30, what="its KV blocks freed")
    assert value(tight_pool.scrape(), "nanovllm_num_requests_running", worker=address) == 0
