"""The asynchronous engine loop against a scripted worker (no torch): streaming, one step of
lookahead, multi-iteration decode, a failing worker reply, and recovery from a lost worker."""
from __future__ import annotations

import asyncio

import pytest

from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.sequence import FinishReason
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.observe.load_report import LoadReport
from scheduler_service.observe.metrics import ServiceMetrics

VOCAB = 100


def next_token(history: list[int]) -> int:
    """The scripted model: the next token is a function of the tokens so far."""
    return (sum(history) * 31 + len(history)) % VOCAB


class ScriptedWorker:
    """Speaks the Step protocol like a worker, sampling next_token(history)."""

    address = "scripted"
    uses_tls = False

    def __init__(self, num_kv_blocks: int = 64) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.histories: dict[int, list[int]] = {}
        self.fail_step_ids: set[int] = set()
        self.lose_connection_at_step: int | None = None
        self.last_step_id = 0
        self.num_steps = 0

    async def describe(self) -> worker_pb2.DescribeResponse:
        return worker_pb2.DescribeResponse(model_name="scripted", block_size=16, max_model_len=512, vocab_size=VOCAB,
                                           num_kv_blocks=self.num_kv_blocks, eos_token_ids=[])

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse:
        self.histories.clear()
        self.last_step_id = 0
        return worker_pb2.InitCacheResponse(num_kv_blocks=num_kv_blocks)

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        await asyncio.sleep(0)
        self.num_steps += 1
        if self.lose_connection_at_step == request.step_id:
            self.lose_connection_at_step = None
            raise ConnectionError("worker went away")
        assert request.step_id == self.last_step_id + 1
        self.last_step_id = request.step_id
        for seq_id in request.released_seq_ids:
            self.histories.pop(seq_id, None)
        reply_id = request.step_id
        if request.step_id in self.fail_step_ids:  # once: the engine starts over from step 1
            self.fail_step_ids.discard(request.step_id)
            reply_id += 1000
        response = worker_pb2.StepResponse(step_id=reply_id)
        for new in request.new_sequences:
            history = self.histories[new.seq_id] = [0] * new.num_computed_tokens + list(new.token_ids)
            if len(history) == new.num_tokens:
                self._sample(new.seq_id, history, 1, response)
        for running in request.running_sequences:
            history = self.histories[running.seq_id]
            history.extend(running.token_ids)
            self._sample(running.seq_id, history, max(request.num_decode_steps, 1), response)
        return response

    def _sample(self, seq_id: int, history: list[int], count: int, response: worker_pb2.StepResponse) -> None:
        for _ in range(count):
            token = next_token(history)
            history.append(token)
            response.tokens.add(seq_id=seq_id, token_id=token)

    async def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.histories.pop(seq_id, None)

    async def heartbeat(self, timeout_s: float) -> None:
        await asyncio.sleep(0)

    async def end_session(self) -> None:
        pass

    async def close(self) -> None:
        pass


def expected_tokens(prompt: list[int], count: int) -> list[int]:
    history = list(prompt)
    for _ in range(count):
        history.append(next_token(history))
    return history[len(prompt):]


async def collect(engine: AsyncEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], FinishReason | None]:
    tokens, reason = [], None
    async for output in engine.generate(prompt, SamplingParams(max_tokens=max_tokens)):
        tokens += output.token_ids
        reason = output.finish_reason
    return tokens, reason


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # a hang fails the test instead of the suite


def all_blocks_free(engine: AsyncEngine) -> bool:
    return all(stats.num_free_kv_blocks == stats.num_kv_blocks for _, stats in engine.worker_stats())


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_concurrent_requests_stream_the_scripted_tokens(num_decode_steps: int) -> None:
    async def scenario() -> None:
        worker = ScriptedWorker()
        engine = await AsyncEngine.start(SchedulerConfig(num_decode_steps=num_decode_steps), worker, None)
        await engine.wait_ready(5)
        prompts = [[i, i + 1, i + 2] for i in range(8)]
        results = await asyncio.gather(*(collect(engine, p, 20 + i) for i, p in enumerate(prompts)))
        for i, (prompt, (tokens, reason)) in enumerate(zip(prompts, results, strict=True)):
            assert tokens == expected_tokens(prompt, 20 + i)
            assert reason is FinishReason.LENGTH
        assert all_blocks_free(engine)
        await engine.shutdown(0)

    run(scenario())


def test_a_bad_worker_reply_fails_the_requests_instead_of_hanging() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker()
        worker.fail_step_ids = {3}
        engine = await AsyncEngine.start(SchedulerConfig(), worker, None)
        await engine.wait_ready(5)
        with pytest.raises(RuntimeError, match="the engine failed"):
            await collect(engine, [1, 2, 3], 50)
        # The engine starts over and serves the next request.
        await engine.wait_ready(5)
        tokens, _ = await collect(engine, [4, 5], 10)
        assert tokens == expected_tokens([4, 5], 10)
        await engine.shutdown(0)

    run(scenario())


def test_a_lost_worker_loses_no_request() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker()
        worker.lose_connection_at_step = 4
        metrics = ServiceMetrics()
        engine = await AsyncEngine.start(SchedulerConfig(), worker, None, observer=metrics)
        await engine.wait_ready(5)
        tokens, reason = await collect(engine, [7, 8, 9], 30)
        assert worker.lose_connection_at_step is None  # the connection was lost mid-request
        assert tokens == expected_tokens([7, 8, 9], 30) and reason is FinishReason.LENGTH
        assert metrics.counters.worker_recoveries == 1
        await engine.shutdown(0)

    run(scenario())


def test_abandoned_stream_frees_its_blocks() -> None:
    async def scenario() -> None:
        engine = await AsyncEngine.start(SchedulerConfig(), ScriptedWorker(), None)
        await engine.wait_ready(5)
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=200))
        await stream.__anext__()
        load = LoadReport.of(engine.worker_stats())
        ((_, stats),) = load.workers
        assert (load.num_running, load.num_waiting, load.num_workers_ready) == (1, 0, 1)
        assert load.kv_cache_usage == 1 - stats.num_free_kv_blocks / stats.num_kv_blocks > 0
        await stream.aclose()
        assert all_blocks_free(engine) and engine.num_unfinished == 0
        load = LoadReport.of(engine.worker_stats())
        assert load.num_running == 0 and load.kv_cache_usage == 0
        await engine.shutdown(0)

    run(scenario())


def test_data_parallel_lanes_share_the_requests() -> None:
    async def scenario() -> None:
        workers = [ScriptedWorker(num_kv_blocks=32), ScriptedWorker(num_kv_blocks=48)]
        workers[1].lose_connection_at_step = 3  # one lane reconnects mid-way; its requests carry on
        engine = await AsyncEngine.start(SchedulerConfig(), workers, None)
        await engine.wait_ready(5)
        while len(engine.ready_lanes) < 2:
            await engine.wait_ready(5)
            await asyncio.sleep(0)
        assert sum(stats.num_kv_blocks for _, stats in engine.worker_stats()) == 80
        prompts = [[i, 2 * i, 3 * i] for i in range(1, 9)]
        results = await asyncio.gather(*(collect(engine, p, 25) for p in prompts))
        assert workers[1].lose_connection_at_step is None  # the lane did reconnect
        assert [tokens for tokens, _ in results] == [expected_tokens(p, 25) for p in prompts]
        assert all(worker.num_steps > 0 for worker in workers)
        assert all_blocks_free(engine)
        await engine.shutdown(0)

    run(scenario())
