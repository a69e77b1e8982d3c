"""Data-parallel routing by outstanding tokens: the counts themselves, and a long request on one lane
sending the short ones that follow to the other."""
from __future__ import annotations

import asyncio

from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.lanes.lane_loads import LaneLoads
from tests.scheduler_service.test_async_engine import ScriptedWorker, collect, expected_tokens, run


def test_a_request_counts_its_prompt_until_its_first_token_and_its_remaining_outputs() -> None:
    loads = LaneLoads()
    charge = loads.admit("a", num_prompt_tokens=100, max_output_tokens=50)
    loads.admit("b", num_prompt_tokens=10, max_output_tokens=20)
    assert (loads.num_tokens("a"), loads.num_tokens("b")) == (150, 30)
    assert loads.least_loaded(["a", "b"]) == "b"
    loads.progress(charge, 4)  # the prompt is computed, 4 of 50 tokens out
    assert loads.num_tokens("a") == 46
    loads.progress(charge, 100)  # never below what the request still counted
    assert loads.num_tokens("a") == 0
    loads.finish(charge)
    assert loads.num_tokens("a") == 0 and loads.least_loaded(["a", "b"]) == "a"


def test_an_aborted_request_stops_counting() -> None:
    loads = LaneLoads()
    charge = loads.admit("a", 7, 9)
    loads.progress(charge, 2)
    loads.finish(charge)
    assert loads.num_tokens("a") == 0


class RecordingWorker(ScriptedWorker):
    """Remembers the prompt of every sequence it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[int]] = []

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        self.prompts += [list(new.token_ids) for new in request.new_sequences]
        return await super().step(request, timeout_s)


def test_short_requests_go_to_the_lane_without_the_long_one() -> None:
    async def scenario() -> None:
        workers = [RecordingWorker(), RecordingWorker()]
        engine = await AsyncEngine.start(SchedulerConfig(), workers, None)
        while len(engine.ready_lanes) < 2:
            await engine.wait_ready(5)
            await asyncio.sleep(0)
        long_prompt = list(range(1, 41))
        long = engine.generate(long_prompt, SamplingParams(max_tokens=400))
        await long.__anext__()  # routed to the first lane, its prompt computed
        short_prompts = [[50 + i, 60 + i] for i in range(4)]
        # By request count they would alternate between the lanes; by tokens, 4 x 10 stays below
        # the long one's outstanding ~400.
        results = await asyncio.gather(*(collect(engine, prompt, 8) for prompt in short_prompts))
        assert [tokens for tokens, _ in results] == [expected_tokens(p, 8) for p in short_prompts]
        assert workers[0].prompts == [long_prompt]
        assert workers[1].prompts == short_prompts
        assert engine.lane_loads.num_tokens(engine.lanes[1]) == 0
        await long.aclose()
        assert [engine.lane_loads.num_tokens(lane) for lane in engine.lanes] == [0, 0]
        await engine.shutdown(0)

    run(scenario())
