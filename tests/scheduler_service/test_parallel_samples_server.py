"""Parallel samples (n) end to end: the Python client, the public gRPC server over a real socket, the
real AsyncEngine and scheduler, and a scripted worker with a paged cache of token ids
(paged_worker.py), so that what a sample reads from the blocks its leader wrote shows in its tokens."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator

import grpc
import pytest

from common.client import GenerationClient, GenerationResult
from common.contract.config import SchedulerConfig
from common.contract.sampling_params import MAX_LOGIT_BIAS, MAX_N, SamplingParams
from scheduler_service.api.tokenizer import load_tokenizer
from scheduler_service.core.samples import sample_params
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.observe.metrics import ServiceMetrics
from tests.loop_thread import LoopThread, PublicServerThread
from tests.scheduler_service.paged_worker import PagedWorker, expected_tokens
from tests.scheduler_service.public_server_harness import EOS_ID, WORDS, save_tiny_tokenizer

LOW = 6  # the worker samples the words "hello" .. "mat" (ids 6..13), never EOS
VOCAB_SIZE = len(WORDS)


def prompt(offset: int) -> list[int]:
    """37 word ids (two full blocks of 16 and 5 more), a different prompt per offset."""
    return [LOW + (i * 5 + offset) % (VOCAB_SIZE - LOW) for i in range(37)]


class ScriptedServer(PublicServerThread):
    """The real AsyncEngine over a PagedWorker, served by the public server from a loop thread."""

    def __init__(self, tokenizer: object) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.worker = PagedWorker(vocab_size=VOCAB_SIZE, low=LOW, eos_token_ids=(EOS_ID,))
        self.metrics = ServiceMetrics()
        self.engine: AsyncEngine | None = None

    def start(self) -> ScriptedServer:
        self.loop_thread = LoopThread("parallel-samples")

        async def build() -> None:
            self.engine = await AsyncEngine.start(SchedulerConfig(), self.worker, self.tokenizer, {EOS_ID},
                                                  observer=self.metrics)
            await self.engine.wait_ready(10)
            await self.serve(self.engine, metrics=self.metrics)

        self.run(build())
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self.engine is not None and self.public is not None
            await self.engine.shutdown(grace_s=0)
            await self.public.stop(grace=None)

        self.run(shutdown())
        assert self.loop_thread is not None
        self.loop_thread.close()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    tokenizer = load_tokenizer(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))))
    thread = ScriptedServer(tokenizer).start()
    yield thread
    thread.stop()


@pytest.fixture
def client(server: ScriptedServer) -> Iterator[GenerationClient]:
    with GenerationClient(server.target, timeout=30) as client:
        client.wait_ready(timeout=10)
        yield client


def expected(prompt_ids: list[int], index: int, **options: object) -> list[int]:
    """Sample index's tokens for a request with these options (max_tokens of them, cut at a stop token)."""
    params = sample_params(SamplingParams(**options), index)  # type: ignore[arg-type]
    tokens = expected_tokens(prompt_ids, params, params.max_tokens, LOW, VOCAB_SIZE)
    stop = next((i for i, t in enumerate(tokens) if t in params.stop_token_ids), None)
    return tokens if stop is None else tokens[:stop + 1]


def texts(result: GenerationResult) -> list[str]:
    return [sample.text for sample in result.samples]


def test_seeded_samples_differ_are_reproducible_and_sample_0_is_the_single_request(
        client: GenerationClient, server: ScriptedServer) -> None:
    ids = prompt(0)
    first = client.generate(ids, n=4, seed=3, max_tokens=8)
    again = client.generate(ids, n=4, seed=3, max_tokens=8)
    assert [s.index for s in first.samples] == [0, 1, 2, 3]
    assert [s.token_ids for s in first.samples] == [expected(ids, i, n=4, seed=3, max_tokens=8) for i in range(4)]
    assert len(set(texts(first))) == 4  # each sample its own seed stream
    assert texts(again) == texts(first) and [s.token_ids for s in again.samples] == [s.token_ids for s in first.samples]
    single = client.generate(ids, seed=3, max_tokens=8)
    assert (single.text, single.token_ids, single.samples) == (first.samples[0].text, first.samples[0].token_ids, [])
    # The top-level fields are sample 0's; usage counts every sample's tokens, the prompt's once.
    assert (first.text, first.token_ids, first.finish_reason) == (texts(first)[0], first.samples[0].token_ids,
                                                                   "length")
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (37, 4 * 8)
    assert again.usage.cached_tokens == 32  # the second run's sample 0 found the whole first two blocks


def test_greedy_samples_are_identical(client: GenerationClient) -> None:
    result = client.generate(prompt(1), n=2, temperature=0, max_tokens=6)
    assert result.samples[0].token_ids == result.samples[1].token_ids == expected(prompt(1), 0, temperature=0,
                                                                                  max_tokens=6)
    assert result.samples[0].text == result.samples[1].text != ""


def test_the_prompt_is_prefilled_once(client: GenerationClient, server: ScriptedServer) -> None:
    assert server.engine is not None
    ((_, before),) = server.engine.worker_stats()
    computed, prompt_tokens = server.worker.num_prompt_tokens_computed, server.sample("nanovllm_prompt_tokens_total")
    successes = server.sample("nanovllm_request_success_total", {"finish_reason": "length"})
    result = client.generate(prompt(2), n=3, seed=9, max_tokens=5)
    ((_, after),) = server.engine.worker_stats()
    assert after.num_prefix_query_tokens - before.num_prefix_query_tokens == 3 * 37
    assert after.num_prefix_hit_tokens - before.num_prefix_hit_tokens == 2 * 32  # the samples on sample 0's blocks
    assert server.worker.num_prompt_tokens_computed - computed == 37 + 2 * 5
    assert result.usage.cached_tokens == 0
    # One request in the metrics: its prompt counted once, one success.
    assert server.sample("nanovllm_prompt_tokens_total") - prompt_tokens == 37
    assert server.sample("nanovllm_request_success_total", {"finish_reason": "length"}) - successes == 1


def test_each_sample_finishes_for_its_own_reason(client: GenerationClient) -> None:
    options = {"n": 3, "seed": 1, "max_tokens": 6, "stop_token_ids": [LOW]}
    result = client.generate(prompt(3), **options)
    tokens = [expected(prompt(3), i, **options) for i in range(3)]
    reasons = ["stop" if LOW in t else "length" for t in tokens]
    assert sorted(set(reasons)) == ["length", "stop"]  # the seed was chosen so
    assert [(s.token_ids, s.finish_reason) for s in result.samples] == list(zip(tokens, reasons, strict=True))
    assert [s.matched_stop for s in result.samples] == [LOW if r == "stop" else None for r in reasons]
    assert result.usage.completion_tokens == sum(map(len, tokens))


def test_streamed_samples_equal_the_unary_ones(client: GenerationClient) -> None:
    options = {"n": 3, "seed": 21, "max_tokens": 7, "stop_token_ids": [LOW + 1]}
    unary = client.generate(prompt(4), **options)
    deltas = list(client.stream(prompt(4), **options))
    for sample in unary.samples:
        mine = [d for d in deltas if d.index == sample.index]
        assert "".join(d.text for d in mine) == sample.text
        assert [t for d in mine for t in d.token_ids] == sample.token_ids
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [sample.finish_reason]
        last = mine[-1]
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (37, len(sample.token_ids))
        assert all(d.usage is None for d in mine[:-1])
    assert deltas[-1].finish_reason is not None  # the stream ends once every sample has finished


def test_cancelling_a_stream_of_3_samples_frees_every_block(client: GenerationClient, server: ScriptedServer) -> None:
    """Steps are held after the next 5 (the samples have streamed a few tokens each by then), so that
    the request is still running when the cancellation arrives; the request's log line says when the
    server has ended it."""
    assert server.engine is not None and server.loop_thread is not None
    loop, worker = server.loop_thread.loop, server.worker
    worker.gate, worker.steps_before_gate = asyncio.Event(), 5
    first_new = len(worker.seen_seq_ids)
    try:
        with request_logged("cancelled") as lines:
            seen: set[int] = set()
            stream = client.stream(prompt(5), n=3, seed=4, max_tokens=400, request_id="cancelled")
            for delta in stream:
                seen.add(delta.index)
                if seen == {0, 1, 2}:
                    break
            stream.close()  # cancels the call
            assert lines.wait(10) and lines.fields["status"] == "CANCELLED"
    finally:
        loop.call_soon_threadsafe(worker.gate.set)  # type: ignore[union-attr]
    ((_, stats),) = server.engine.worker_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and server.engine.num_unfinished == 0
    samples = set(worker.seen_seq_ids[first_new:])
    assert len(samples) == 3
    server.run(asyncio.wait_for(worker.until_released(samples), 10))  # the worker is told of each
    worker.gate = worker.steps_before_gate = None


def test_a_request_of_3_samples_is_one_request_in_the_metrics_and_the_log(client: GenerationClient,
                                                                          server: ScriptedServer) -> None:
    counted = {"nanovllm_request_success_total": {"finish_reason": "length"},
               "nanovllm_prompt_tokens_total": {}, "nanovllm_generation_tokens_total": {},
               "nanovllm_time_to_first_token_seconds_count": {}, "nanovllm_inter_token_latency_seconds_count": {},
               "nanovllm_e2e_request_latency_seconds_count": {}, "nanovllm_request_generation_tokens_sum": {}}
    before = {name: server.sample(name, labels) for name, labels in counted.items()}
    with request_logged("three") as line:
        deltas = list(client.stream(prompt(7), n=3, seed=2, max_tokens=4, request_id="three"))
        assert line.wait(10)
    num_leader_deltas = sum(1 for d in deltas if d.index == 0 and d.token_ids)
    assert {name: server.sample(name, labels) - before[name] for name, labels in counted.items()} == {
        "nanovllm_request_success_total": 1, "nanovllm_prompt_tokens_total": 37,
        "nanovllm_generation_tokens_total": 12, "nanovllm_time_to_first_token_seconds_count": 1,
        "nanovllm_inter_token_latency_seconds_count": num_leader_deltas - 1,  # along sample 0's deltas
        "nanovllm_e2e_request_latency_seconds_count": 1, "nanovllm_request_generation_tokens_sum": 12}
    assert line.num_lines == 1
    assert {key: line.fields[key] for key in ("status", "finish_reason", "prompt_tokens", "completion_tokens")} == {
        "status": "OK", "finish_reason": "length", "prompt_tokens": 37, "completion_tokens": 12}


class _RequestLine(logging.Handler):
    """Catches the one log line of a request (written when the server's handler ends, which for a
    stream may be after the client saw its last message)."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.fields: dict = {}
        self.num_lines = 0
        self._written = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if fields.get("request_id") == self.request_id:
            self.fields = fields
            self.num_lines += 1
            self._written.set()

    def wait(self, timeout_s: float) -> bool:
        return self._written.wait(timeout_s)


@contextlib.contextmanager
def request_logged(request_id: str) -> Iterator[_RequestLine]:
    requests_log = logging.getLogger("nanovllm.requests")
    handler, level = _RequestLine(request_id), requests_log.level
    requests_log.setLevel(logging.INFO)
    requests_log.addHandler(handler)
    try:
        yield handler
    finally:
        requests_log.removeHandler(handler)
        requests_log.setLevel(level)


def test_n_out_of_range_is_invalid_and_model_info_states_the_limits(client: GenerationClient) -> None:
    for n in (0, MAX_N + 1):
        with pytest.raises(grpc.RpcError) as raised:
            client.generate(prompt(6), n=n)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details() == f"n: must be in [1, {MAX_N}], got {n}"
    info = client.model_info()
    assert (info.max_n, info.max_logit_bias) == (MAX_N, MAX_LOGIT_BIAS)
