"""Parallel samples (n) in the engine: each sample's parameters, one prefill shared through the prefix
cache (the other samples wait for sample 0's prompt without holding up other requests, also after a
lost worker; without prefix caching they prefill themselves), each sample stopping on its own, and in
the async engine: one lane, charged n times, outputs tagged by index, cancellation and failures
ending every sample."""
from __future__ import annotations

import asyncio

import pytest

from common.contract.config import SchedulerConfig
from common.contract.sampling_params import MAX_SEED, SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.errors import EngineUnavailableError, QueueFullError
from scheduler_service.core.samples import sample_params, sample_seed
from scheduler_service.core.sequence import FinishReason
from scheduler_service.core.step_builder import InFlightStep
from scheduler_service.lanes.async_engine import AsyncEngine
from tests.scheduler_service.paged_worker import PagedWorker, expected_tokens
from tests.scheduler_service.test_engine_core import INFO

PROMPT = list(range(1, 41))  # 40 tokens: 2 full blocks of 16 and 8 more


def attached(**options: object) -> EngineCore:
    core = EngineCore(SchedulerConfig(**options))  # type: ignore[arg-type]
    core.attach(INFO, INFO.num_kv_blocks)
    return core


def reply(step: InFlightStep, token_id: int = 3) -> worker_pb2.StepResponse:
    """One token for every sequence of the step that finishes its prefill or decodes."""
    response = worker_pb2.StepResponse(step_id=step.step_id)
    for item in [*step.request.new_sequences, *step.request.running_sequences]:
        response.tokens.add(seq_id=item.seq_id, token_id=token_id)
    return response


def new_sequences(step: InFlightStep) -> list[tuple[int, int, int]]:
    """(seq id, tokens already computed, tokens to compute) of each sequence new on the worker."""
    return [(new.seq_id, new.num_computed_tokens, len(new.token_ids)) for new in step.request.new_sequences]


def test_each_sample_gets_n_1_and_a_seed_stream_of_its_own() -> None:
    params = SamplingParams(n=4, seed=11, num_prompt_logprobs=2)
    samples = [sample_params(params, index) for index in range(4)]
    assert [p.n for p in samples] == [1] * 4
    assert samples[0].seed == 11 and samples[0].num_prompt_logprobs == 2
    assert all(p.num_prompt_logprobs is None for p in samples[1:])  # the prompt's scores are sample 0's
    seeds = [p.seed for p in samples]
    assert len(set(seeds)) == 4 and all(0 <= s < MAX_SEED for s in seeds)  # type: ignore[operator]
    assert seeds == [sample_seed(11, index) for index in range(4)]  # a function of (seed, index) alone
    assert sample_seed(12, 1) != seeds[1] and sample_seed(2**63 - 1, 31) < MAX_SEED
    assert [sample_params(SamplingParams(n=3), i).seed for i in range(3)] == [None] * 3


def test_samples_wait_for_the_leaders_prompt_then_hit_its_blocks_and_others_pass_them() -> None:
    core = attached()
    leader, first, second = core.add_samples(PROMPT, SamplingParams(n=3, max_tokens=20))
    other = core.add_request([90, 91, 92], SamplingParams(max_tokens=20))
    assert [s.sample_index for s in (leader, first, second)] == [0, 1, 2]
    prefill = core.build_step()
    # The samples are skipped; the request queued behind them is not held up.
    assert new_sequences(prefill) == [(leader.seq_id, 0, 40), (other.seq_id, 0, 3)]
    ahead = core.build_step()  # built before the prefill's reply: the leader's blocks are not cached yet
    assert new_sequences(ahead) == []
    core.process_step(prefill, reply(prefill))
    shared = core.build_step()
    # Only the last partial block is computed: 8 tokens each, on the leader's two full blocks.
    assert new_sequences(shared) == [(first.seq_id, 32, 8), (second.seq_id, 32, 8)]
    assert first.block_table[:2] == second.block_table[:2] == leader.block_table[:2]
    stats = core.stats()
    assert (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (40 + 3 + 40 + 40, 32 + 32)


def test_after_a_lost_worker_the_samples_wait_for_the_leaders_prompt_again() -> None:
    core = attached()
    leader, sample = core.add_samples(PROMPT, SamplingParams(n=2, max_tokens=20))
    assert new_sequences(core.build_step()) == [(leader.seq_id, 0, 40)]
    core.detach()  # lost before the prefill's reply: the new worker's cache holds nothing
    core.attach(INFO, INFO.num_kv_blocks)
    prefill = core.build_step()
    assert new_sequences(prefill) == [(leader.seq_id, 0, 40)]
    assert new_sequences(core.build_step()) == []
    core.process_step(prefill, reply(prefill))
    assert new_sequences(core.build_step()) == [(sample.seq_id, 32, 8)]


def test_without_prefix_caching_every_sample_prefills_its_prompt() -> None:
    core = attached(enable_prefix_caching=False)
    sequences = core.add_samples(PROMPT, SamplingParams(n=3, max_tokens=20))
    assert new_sequences(core.build_step()) == [(seq.seq_id, 0, 40) for seq in sequences]


def test_samples_of_a_finished_leader_wait_no_more() -> None:
    core = attached()
    leader, sample = core.add_samples(PROMPT, SamplingParams(n=2, max_tokens=20))
    core.build_step()
    core.abort(leader)
    assert new_sequences(core.build_step()) == [(sample.seq_id, 0, 40)]


def test_each_sample_stops_on_its_own() -> None:
    core = attached()
    leader, sample = core.add_samples([5, 6, 7], SamplingParams(n=2, max_tokens=2, stop_token_ids=[42]))
    prefill = core.build_step()  # a prompt of no full block: nothing to wait for
    assert new_sequences(prefill) == [(leader.seq_id, 0, 3), (sample.seq_id, 0, 3)]
    ahead = core.build_step()
    response = worker_pb2.StepResponse(step_id=prefill.step_id)
    response.tokens.add(seq_id=leader.seq_id, token_id=42)
    response.tokens.add(seq_id=sample.seq_id, token_id=8)
    outputs = core.process_step(prefill, response)
    assert [(o.seq_id, o.finished) for o in outputs] == [(leader.seq_id, True), (sample.seq_id, False)]
    assert (leader.finish_reason, leader.matched_stop) == (FinishReason.STOP, 42)
    (output,) = core.process_step(ahead, reply(ahead, 9))
    assert (output.seq_id, output.finish_reason, sample.output_token_ids) == (sample.seq_id, FinishReason.LENGTH,
                                                                             [8, 9])


def test_a_request_of_more_samples_than_the_queue_holds_queues_none() -> None:
    core = attached(max_queue_size=4)
    core.add_request([1, 2], SamplingParams())
    with pytest.raises(QueueFullError, match="^queue: full"):
        core.add_samples(PROMPT, SamplingParams(n=4))
    assert core.num_unfinished == 1
    assert len(core.add_samples(PROMPT, SamplingParams(n=3))) == 3


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # a hang fails the test instead of the suite


async def ready(workers: list[PagedWorker]) -> AsyncEngine:
    engine = await AsyncEngine.start(SchedulerConfig(), workers, None)
    while len(engine.ready_lanes) < len(workers):
        await engine.wait_ready(5)
        await asyncio.sleep(0)
    return engine


def test_the_samples_stay_on_one_lane_charged_as_n_requests_and_stream_tagged_by_index() -> None:
    async def scenario() -> None:
        workers = [PagedWorker(), PagedWorker()]
        gate = asyncio.Event()
        for worker in workers:
            worker.gate = gate
        engine = await ready(workers)
        params = SamplingParams(n=3, max_tokens=6, seed=5)
        stream = engine.generate(PROMPT, params)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request's task runs until it waits for outputs: its samples are queued
        lanes, loads = engine.lanes, engine.lane_loads
        assert (loads.num_tokens(lanes[0]), loads.num_tokens(lanes[1])) == (3 * (40 + 6), 0)
        single = engine.generate([7, 8, 9], SamplingParams(max_tokens=4, seed=5))
        single_first = asyncio.ensure_future(single.__anext__())
        await asyncio.sleep(0)
        assert loads.num_tokens(lanes[1]) == 3 + 4  # the lane with less work
        gate.set()
        outputs = [await first] + [output async for output in stream]
        single_tokens = [t for o in [await single_first] + [o async for o in single] for t in o.token_ids]
        assert single_tokens == expected_tokens([7, 8, 9], SamplingParams(seed=5), 4, 0, 100)
        by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for output in outputs:
            by_index[output.index] += output.token_ids
        assert by_index == {i: expected_tokens(PROMPT, sample_params(params, i), 6, 0, 100) for i in range(3)}
        assert sorted(o.index for o in outputs if o.finished) == [0, 1, 2] and outputs[-1].finished
        assert (len(workers[0].seen_seq_ids), len(workers[1].seen_seq_ids)) == (3, 1)
        assert (loads.num_tokens(lanes[0]), loads.num_tokens(lanes[1])) == (0, 0)
        assert workers[0].num_prompt_tokens_computed == 40 + 8 + 8  # one prefill, the rest from its blocks
        await engine.shutdown(0)

    run(scenario())


def test_closing_the_stream_aborts_every_sample_and_frees_their_blocks() -> None:
    async def scenario() -> None:
        worker = PagedWorker()
        engine = await ready([worker])
        stream = engine.generate(PROMPT, SamplingParams(n=3, max_tokens=300, seed=1))
        seen: set[int] = set()
        async for output in stream:
            seen.add(output.index)
            if seen == {0, 1, 2}:
                break
        await stream.aclose()
        ((_, stats),) = engine.worker_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks and engine.num_unfinished == 0
        assert engine.lane_loads.num_tokens(engine.lanes[0]) == 0
        assert len(worker.seen_seq_ids) == 3
        await asyncio.wait_for(worker.until_released(set(worker.seen_seq_ids)), 10)
        await engine.shutdown(0)

    run(scenario())


def test_a_failed_step_ends_every_sample() -> None:
    async def scenario() -> None:
        worker = PagedWorker()
        worker.fail_step_ids = {4}
        engine = await ready([worker])
        with pytest.raises(RuntimeError, match="the engine failed"):
            async for _ in engine.generate(PROMPT, SamplingParams(n=3, max_tokens=50)):
                pass
        assert engine.num_unfinished == 0 and engine.lane_loads.num_tokens(engine.lanes[0]) == 0
        await engine.shutdown(0)

    run(scenario())


def test_a_drain_ends_every_sample_with_unavailable() -> None:
    async def scenario() -> None:
        engine = await ready([PagedWorker()])
        stream = engine.generate(PROMPT, SamplingParams(n=3, max_tokens=300))
        await stream.__anext__()
        await engine.shutdown(0)
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            async for _ in stream:
                pass
        assert engine.num_unfinished == 0

    run(scenario())
