"""How the engine loop treats each kind of worker fault (scheduler_service/worker_faults.py),
against the scripted worker (no torch): a protocol error fails only its step's requests, once; a
Step that never returns hits its deadline over real gRPC and its requests are recomputed; a lost
session is recomputed; a worker that stays lost fails the parked requests after the worker timeout."""
from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest

from common.config import SchedulerConfig
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.sampling_params import SamplingParams
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.engine_core import InFlightStep, drive
from scheduler_service.errors import WorkerLostError, WorkerStepError
from scheduler_service.sequence import FinishReason
from scheduler_service.worker_client import GrpcWorkerClient
from tests.scheduler_service.test_async_engine import ScriptedWorker, collect, expected_tokens, run
from tests.services_harness import LINK

POISON = 99  # a prompt holding this token makes the scripted worker refuse the step


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FaultyWorker(ScriptedWorker):
    """Refuses (INVALID_ARGUMENT) every step that admits a poisoned prompt; can drop its session once."""

    def __init__(self) -> None:
        super().__init__()
        self.num_refused = 0
        self.num_claims = 0
        self.drop_session_at_step: int | None = None

    async def init_cache(self, num_kv_blocks: int) -> worker_pb2.InitCacheResponse:
        self.num_claims += 1
        return await super().init_cache(num_kv_blocks)

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        if any(POISON in new.token_ids for new in request.new_sequences):
            self.num_refused += 1
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: refused")
        if request.step_id == self.drop_session_at_step:
            self.drop_session_at_step = None
            raise rpc_error(grpc.StatusCode.ABORTED, "session: gone")
        return await super().step(request, timeout_s)


def test_a_protocol_error_fails_only_its_steps_requests_once() -> None:
    async def scenario() -> None:
        worker = FaultyWorker()
        # One sequence per step: the poisoned request's step holds nothing else.
        engine = await AsyncEngine.start(SchedulerConfig(max_num_seqs=1), worker, None)
        await engine.wait_ready(5)
        poisoned = asyncio.create_task(collect(engine, [1, POISON, 2], 20))
        healthy = asyncio.create_task(collect(engine, [4, 5, 6], 20))
        with pytest.raises(WorkerStepError):
            await poisoned
        tokens, reason = await healthy
        assert tokens == expected_tokens([4, 5, 6], 20) and reason is FinishReason.LENGTH
        assert worker.num_refused == 1  # never retried: no recompute loop
        tokens, _ = await collect(engine, [7, 8], 10)  # the engine carries on
        assert tokens == expected_tokens([7, 8], 10)
        await engine.shutdown(0)

    run(scenario())


def test_a_lost_session_is_recomputed() -> None:
    async def scenario() -> None:
        worker = FaultyWorker()
        worker.drop_session_at_step = 4
        engine = await AsyncEngine.start(SchedulerConfig(), worker, None)
        await engine.wait_ready(5)
        tokens, _ = await collect(engine, [3, 1, 4], 30)
        assert worker.drop_session_at_step is None and worker.num_claims == 2
        assert tokens == expected_tokens([3, 1, 4], 30)
        await engine.shutdown(0)

    run(scenario())


class ScriptedServicer(worker_pb2_grpc.WorkerServicer):
    """The scripted worker behind a real gRPC server; the Step of hang_step_id never returns."""

    def __init__(self, worker: ScriptedWorker, hang_step_id: int) -> None:
        self.worker = worker
        self.hang_step_id: int | None = hang_step_id
        self.num_claims = 0

    async def Describe(self, request, context):  # noqa: N802
        return await self.worker.describe()

    async def InitCache(self, request, context):  # noqa: N802
        self.num_claims += 1
        return await self.worker.init_cache(request.num_kv_blocks)

    async def Step(self, request, context):  # noqa: N802
        if request.step_id == self.hang_step_id:
            self.hang_step_id = None
            await asyncio.Event().wait()  # never set: this call can only end by its deadline
        return await self.worker.step(request)

    async def Release(self, request, context):  # noqa: N802
        await self.worker.release(list(request.seq_ids))
        return worker_pb2.ReleaseResponse()


def test_a_step_that_never_returns_hits_its_deadline_and_is_recomputed() -> None:
    async def scenario() -> None:
        servicer = ScriptedServicer(ScriptedWorker(), hang_step_id=3)
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        config = SchedulerConfig(step_timeout_base_s=1.0, step_timeout_per_token_s=0.0)
        engine = await AsyncEngine.start(config, GrpcWorkerClient(f"127.0.0.1:{port}", LINK), None)
        await engine.wait_ready(10)
        tokens, _ = await collect(engine, [2, 7, 1], 25)
        assert servicer.hang_step_id is None and servicer.num_claims == 2  # it hung, then recomputed
        assert tokens == expected_tokens([2, 7, 1], 25)
        await engine.shutdown(0)
        await server.stop(None)

    run(scenario())


class VanishingWorker(ScriptedWorker):
    """Loses the connection at step 3 and never answers again."""

    def __init__(self) -> None:
        super().__init__()
        self.is_gone = False

    async def describe(self) -> worker_pb2.DescribeResponse:
        if self.is_gone:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return await super().describe()

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        if request.step_id == 3:
            self.is_gone = True
        if self.is_gone:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection reset")
        return await super().step(request, timeout_s)


def test_parked_requests_end_unavailable_after_the_worker_timeout() -> None:
    async def scenario() -> None:
        worker = VanishingWorker()
        engine = await AsyncEngine.start(SchedulerConfig(worker_timeout_s=0.5), worker, None)
        await engine.wait_ready(5)
        with pytest.raises(WorkerLostError, match="worker lost"):
            async for _ in engine.generate([5, 5, 5], SamplingParams(max_tokens=50)):
                pass
        assert engine.num_unfinished == 0
        await engine.shutdown(0)

    run(scenario())


class TwoStepCore:
    """drive()'s view of an engine with two steps to send."""

    def __init__(self) -> None:
        self.steps = [InFlightStep(i, worker_pb2.StepRequest(step_id=i), {}) for i in (1, 2)]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.steps)

    def build_step(self) -> InFlightStep | None:
        return self.steps.pop(0) if self.steps else None


@pytest.mark.parametrize("as_task", [True, False])
def test_drive_stops_the_step_launched_behind_a_failed_one(as_task: bool) -> None:
    """The lanes launch tasks (cancelled), the offline LLM coroutines (closed, never run)."""
    async def reply(step_id: int) -> worker_pb2.StepResponse:
        if step_id == 1:
            raise rpc_error(grpc.StatusCode.INTERNAL, "step 1 failed")
        await asyncio.sleep(60)  # on the wire
        return worker_pb2.StepResponse(step_id=step_id)

    async def scenario() -> None:
        launched = []

        def launch(step: InFlightStep, ahead: InFlightStep | None):
            launched.append(asyncio.ensure_future(reply(step.step_id)) if as_task else reply(step.step_id))
            return launched[-1]

        failed = []
        with pytest.raises(grpc.aio.AioRpcError):
            await drive(TwoStepCore(), launch, lambda *_: None, lambda step, error: failed.append(step.step_id))
        assert failed == [1]
        if as_task:
            await asyncio.sleep(0)
            assert launched[1].cancelled()
        else:
            assert inspect.getcoroutinestate(launched[1]) == inspect.CORO_CLOSED

    run(scenario())
