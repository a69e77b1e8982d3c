"""The worker's gRPC server: a thin servicer over WorkerCore, plus grpc.health.v1.

Steps may arrive out of order (the scheduler sends step N+1 before step N returns, and separate
calls on one channel are not ordered), so each Step waits for its turn by step_id. A step's turn
ends once it is launched, not once it is done: step N+1 is prepared and queued on the GPU while
step N computes, and each reply waits for its own step's tokens.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.grpc_options import server_options
from worker_service.tp_group import TensorParallelCore
from worker_service.worker import WorkerCore

logger = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore | TensorParallelCore) -> None:
        self.core = core
        self._turn = asyncio.Condition()
        self._next_step_id = 1
        # Model work always runs on this one thread: the CPU backend's intra-op thread team then
        # stays warm (a new OpenMP team per pool thread would halve CPU throughput), and launches
        # are never queued behind a thread waiting for a step's result.
        num_threads = torch.get_num_threads()
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="model",
                                                initializer=lambda: torch.set_num_threads(num_threads))

    async def _on_model_thread(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, function, *args)

    async def Describe(self, request, context):  # noqa: N802 (gRPC method names)
        return self.core.describe(request)

    async def InitCache(self, request, context):  # noqa: N802
        async with self._turn:
            try:
                reply = await self._on_model_thread(self.core.init_cache, request)
            except ValueError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            self._next_step_id = 1
            self._turn.notify_all()
            return reply

    async def Step(self, request, context):  # noqa: N802
        async with self._turn:
            await self._turn.wait_for(lambda: self._next_step_id >= request.step_id)
            if request.step_id != self._next_step_id:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"step_id: expected {self._next_step_id}, got {request.step_id}")
            try:
                pending = await self._on_model_thread(self.core.launch, request)
            except ValueError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            finally:
                # The next step may launch now, while this one runs on the GPU.
                self._next_step_id = request.step_id + 1
                self._turn.notify_all()
        return await asyncio.to_thread(pending.result)

    async def Release(self, request, context):  # noqa: N802
        async with self._turn:
            return self.core.release(request)


async def serve_worker(core: WorkerCore | TensorParallelCore, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Starts the worker's server; returns it and the bound port."""
    server = grpc.aio.server(options=server_options())
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"unix:{host}" if host.startswith("/") else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("worker listening on %s", address if host.startswith("/") else f"{host}:{bound}")
    return server, bound
