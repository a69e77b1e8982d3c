"""How the engine loop treats each kind of worker fault (scheduler_service/lanes/worker_faults.py),
against the scripted worker (no torch): a protocol error fails only its step's requests, once (also
through the public server, with requests in the failed step, in the step after it and waiting); a
Step that never returns hits its deadline over real gRPC and its requests are recomputed; a lost
session is recomputed; a worker that stays lost fails the parked requests after the worker timeout."""
from __future__ import annotations

import asyncio
import inspect
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.client import GenerationClient
from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from scheduler_service.core.errors import WorkerLostError, WorkerStepError
from scheduler_service.core.sequence import FinishReason
from scheduler_service.core.step_builder import InFlightStep
from scheduler_service.core.step_loop import drive
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.lanes.worker_client import GrpcWorkerClient
from tests.loop_thread import LoopThread, PublicServerThread
from tests.scheduler_service.test_async_engine import ScriptedWorker, collect, expected_tokens, run
from tests.services_harness import LINK, wait_until

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

    async def Heartbeat(self, request, context):  # noqa: N802
        return worker_pb2.HeartbeatResponse()

    async def EndSession(self, request, context):  # noqa: N802
        return worker_pb2.EndSessionResponse()


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


class GatedServicer(worker_pb2_grpc.WorkerServicer):
    """The scripted worker behind a real gRPC server. Like a real worker it takes steps in step_id
    order; it refuses (INVALID_ARGUMENT) a step that admits a poisoned prompt, and every later step
    of that claim; every Step waits until the gate opens."""

    def __init__(self) -> None:
        self.worker = ScriptedWorker()
        self.gate = asyncio.Event()
        self.num_received_steps = 0
        self.refused_step_ids: list[int] = []
        self.num_claims = 0
        self._turn = asyncio.Condition()
        self._next_step_id = 1
        self._is_broken = False

    async def Describe(self, request, context):  # noqa: N802
        return await self.worker.describe()

    async def InitCache(self, request, context):  # noqa: N802
        async with self._turn:
            self.num_claims += 1
            self._next_step_id, self._is_broken = 1, False
            return await self.worker.init_cache(request.num_kv_blocks)

    async def Step(self, request, context):  # noqa: N802
        self.num_received_steps += 1
        await self.gate.wait()
        async with self._turn:
            await self._turn.wait_for(lambda: self._next_step_id >= request.step_id)
            self._next_step_id = request.step_id + 1
            self._turn.notify_all()
            if self._is_broken:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "step_id: follows a refused step")
            if any(POISON in new.token_ids for new in request.new_sequences):
                self._is_broken = True
                self.refused_step_ids.append(request.step_id)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: refused")
            return await self.worker.step(request)

    async def Release(self, request, context):  # noqa: N802
        await self.worker.release(list(request.seq_ids))
        return worker_pb2.ReleaseResponse()

    async def Heartbeat(self, request, context):  # noqa: N802
        return worker_pb2.HeartbeatResponse()

    async def EndSession(self, request, context):  # noqa: N802
        return worker_pb2.EndSessionResponse()


class RecordingClient(GrpcWorkerClient):
    """The gRPC worker client, keeping every StepRequest the scheduler sends, in order."""

    def __init__(self, address: str) -> None:
        super().__init__(address, LINK)
        self.sent: list[worker_pb2.StepRequest] = []

    async def step(self, request: worker_pb2.StepRequest, timeout_s: float | None = None) -> worker_pb2.StepResponse:
        self.sent.append(request)
        return await super().step(request, timeout_s)


class ScriptedService(PublicServerThread):
    """The gated scripted worker, the real AsyncEngine and the public server on one event loop in a thread."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__()
        self.config = config
        self.servicer = GatedServicer()
        self.worker_server: grpc.aio.Server | None = None
        self.client: RecordingClient | None = None
        self.engine: AsyncEngine | None = None

    def start(self) -> ScriptedService:
        self.loop_thread = LoopThread("scripted-service")

        async def build() -> None:
            self.worker_server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.worker_server)
            port = self.worker_server.add_insecure_port("127.0.0.1:0")
            await self.worker_server.start()
            self.client = RecordingClient(f"127.0.0.1:{port}")
            self.engine = await AsyncEngine.start(self.config, self.client, None)
            await self.serve(self.engine)

        self.run(build())
        return self

    def open_gate(self) -> None:
        assert self.loop_thread is not None
        self.loop_thread.loop.call_soon_threadsafe(self.servicer.gate.set)

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self.engine is not None and self.public is not None and self.worker_server is not None
            await self.engine.shutdown(grace_s=0)
            await self.public.stop(grace=None)
            await self.worker_server.stop(None)

        self.run(shutdown())
        assert self.loop_thread is not None
        self.loop_thread.close()


def stream_tokens(client: GenerationClient, prompt: list[int], max_tokens: int) -> tuple[list[int], grpc.StatusCode]:
    """The tokens a greedy stream received and how it ended (OK when it finished by length)."""
    tokens: list[int] = []
    try:
        for delta in client.stream(prompt, temperature=0, max_tokens=max_tokens):
            tokens += delta.token_ids
            if delta.finish_reason is not None:
                assert delta.finish_reason == "length"
    except grpc.RpcError as error:
        return tokens, error.code()
    return tokens, grpc.StatusCode.OK


def test_a_protocol_error_fails_its_steps_requests_once_and_the_others_complete(caplog) -> None:
    """R runs alone while every step is held; P (poisoned), H, W and X queue behind it. With 7 tokens
    a step and 4 sequences: step 3 holds R's decode and the prompts of P and H (3 + 3 tokens), step
    4 (on the wire before step 3 returns) admits W, X waits. The worker refuses step 3: R, P and H
    end with INTERNAL, W and X are recomputed on a fresh claim and stream the undisturbed tokens,
    and the scheduler logs the failure in one line, not one per request."""
    caplog.set_level(logging.DEBUG)
    r, p, h, w, x = [3, 1, 4], [1, POISON, 2], [4, 5, 6], [7, 8], [9, 10, 11]
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7, num_decode_steps=1)
    service = ScriptedService(config).start()
    servicer, engine = service.servicer, service.engine
    assert engine is not None and service.client is not None
    try:
        with GenerationClient(service.target, timeout=30) as client, ThreadPoolExecutor(5) as pool:
            client.wait_ready(10)
            streams = {}
            streams["r"] = pool.submit(stream_tokens, client, r, 20)
            # Steps 1 (R's prompt) and 2 (its first decode) are on the wire, held: the loop waits for step 1.
            wait_until(lambda: servicer.num_received_steps == 2, 10, "R's first two steps")
            for count, (name, prompt, max_tokens) in enumerate([("p", p, 20), ("h", h, 20), ("w", w, 12),
                                                                ("x", x, 12)], start=2):
                streams[name] = pool.submit(stream_tokens, client, prompt, max_tokens)
                wait_until(lambda count=count: engine.num_unfinished == count, 10, f"request {name} queued")
            service.open_gate()
            results = {name: future.result(timeout=30) for name, future in streams.items()}
        sent = service.client.sent
    finally:
        service.stop()

    # The arrangement: step 3 computes R, P and H; step 4 admits W; X is in no step of the first claim.
    assert [request.step_id for request in sent[:5]] == [1, 2, 3, 4, 1]
    assert servicer.refused_step_ids == [3] and servicer.num_claims == 2
    r_seq_id = sent[0].new_sequences[0].seq_id
    assert [list(new.token_ids) for new in sent[2].new_sequences] == [p, h]
    assert [running.seq_id for running in sent[2].running_sequences] == [r_seq_id]
    assert [list(new.token_ids) for new in sent[3].new_sequences] == [w]
    assert all(list(new.token_ids) != x for request in sent[:4] for new in request.new_sequences)
    # The fresh claim recomputes W and X from their prompts.
    assert [(list(new.token_ids), new.num_computed_tokens) for new in sent[4].new_sequences] == [(w, 0), (x, 0)]

    # The failed step's requests end with INTERNAL (R after the tokens it streamed before the fault).
    r_tokens, r_code = results["r"]
    assert r_code is grpc.StatusCode.INTERNAL and r_tokens == expected_tokens(r, 20)[:len(r_tokens)]
    assert results["p"] == ([], grpc.StatusCode.INTERNAL)
    assert results["h"] == ([], grpc.StatusCode.INTERNAL)
    # The others complete, token for token as with no fault.
    assert results["w"] == (expected_tokens(w, 12), grpc.StatusCode.OK)
    assert results["x"] == (expected_tokens(x, 12), grpc.StatusCode.OK)

    # Logged once: one line names the worker's error, and it is the scheduler's only warning or error.
    about_the_fault = [record for record in caplog.records if "token_ids: refused" in record.getMessage()]
    assert len(about_the_fault) == 1 and about_the_fault[0].levelno == logging.ERROR
    complaints = [record for record in caplog.records
                  if record.levelno >= logging.WARNING and record.name.startswith("scheduler_service")]
    assert complaints == about_the_fault


class TwoStepCore:
    """drive()'s view of an engine with two steps to send."""

    def __init__(self) -> None:
        self.steps = [InFlightStep(i, worker_pb2.StepRequest(step_id=i), {}) for i in (1, 2)]

    @property
    def num_unfinished(self) -> int:
        return len(self.steps)

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
