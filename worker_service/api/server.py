"""The worker's gRPC server: a thin servicer over WorkerCore, plus grpc.health.v1, behind the
shared secret (common.security.bearer_auth) and the error mapping (common.net.error_mapping).

Steps may arrive out of order (the scheduler sends step N+1 before step N returns, and separate
calls on one channel are not ordered), so each Step waits for its turn by step_id (the core checks
the order). A step's turn ends once it is launched, not once it is done: step N+1 is prepared and
queued on the GPU while step N computes, and each reply waits for its own step's tokens.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.contract.config import WorkerLinkConfig
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.net.grpc_options import new_server
from common.net.ports import WORKER_PORT_IN_USE, grpc_address, listen
from common.security.bearer_auth import BearerTokenInterceptor
from common.security.grpc_logs import install_grpc_log_filter
from common.security.tls import server_credentials
from common.security.worker_secret import SECRET_REFUSAL, accepts_secret
from worker_service.api.statuses import STATUSES, ClaimRefusedError, SessionLostError
from worker_service.runtime.tp_group import TensorParallelCore
from worker_service.runtime.worker import WorkerCore

logger = logging.getLogger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_Result = TypeVar("_Result")


def model_thread() -> ThreadPoolExecutor:
    """The one thread that loads the model and runs all its work. On a CPU, torch's intra-op threads
    form one OpenMP team per thread that runs parallel ops, and with more team threads than cores
    libgomp stops spinning between ops: a second team (a model loaded on another thread) took the
    default model's single-stream decode from ~29 to ~11 tokens/s on 2 cores. One thread also keeps
    launches from queueing behind a thread that waits for a step's result."""
    num_threads = torch.get_num_threads()
    return ThreadPoolExecutor(1, thread_name_prefix="model", initializer=lambda: torch.set_num_threads(num_threads))


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one scheduler session at a time: InitCache claims the worker for a session id, and
    Step, Release, Heartbeat and EndSession name it. A call from any other session is refused before
    it touches anything. The session is a lease: every call of its scheduler renews it, and once
    none came for lease_s seconds (the scheduler vanished) another session may claim the worker
    without takeover. Model work runs on model_thread, the thread that loaded the model."""

    def __init__(self, core: WorkerCore | TensorParallelCore, model_thread: ThreadPoolExecutor,
                 lease_s: float) -> None:
        self.core = core
        self.lease_s = lease_s
        self._turn = asyncio.Condition()
        self._session_id: str | None = None
        self._heard_at = 0.0  # when the session's scheduler last called (time.monotonic)
        # Counts claims: a step that waited for its turn across a claim (even its own session's,
        # which restarts step ids at 1) belongs to state that is gone and must not run.
        self._num_claims = 0
        self._model_thread = model_thread

    async def _on_model_thread(self, function: Callable[..., _Result], *args: object) -> _Result:
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, function, *args)

    def _check_session(self, session_id: str) -> None:
        """Raises SessionLostError unless the worker holds session_id, whose lease it then renews."""
        if not session_id or session_id != self._session_id:
            raise SessionLostError("session: this worker does not hold the caller's session (another scheduler "
                                   "claimed it, or the worker restarted); its state here is gone")
        self._heard_at = time.monotonic()

    def _check_claim(self, request: worker_pb2.InitCacheRequest) -> None:
        if not request.session_id:
            raise ValueError("session_id: required")
        if self._session_id in (None, request.session_id) or request.takeover:
            return
        silent_s = time.monotonic() - self._heard_at
        if silent_s < self.lease_s:
            raise ClaimRefusedError(f"worker: serves another scheduler session, heard from {silent_s:.1f} s ago "
                                    f"(its lease: {self.lease_s:g} s without a call); --worker-takeover takes a live "
                                    "session's worker")

    async def Describe(self, request, context):  # noqa: N802 (gRPC method names)
        return self.core.describe()

    async def InitCache(self, request, context):  # noqa: N802
        self._check_claim(request)  # before waiting for the turn: a refused claim delays nobody
        async with self._turn:
            self._check_claim(request)
            # Raises before dropping anything when the request is invalid: the session holding
            # the worker is then untouched.
            reply = await self._on_model_thread(self.core.init_cache, request)
            if self._session_id not in (None, request.session_id):
                how = "took the worker over" if request.takeover else "claimed the worker after the previous " \
                    f"session's lease ({self.lease_s:g} s) ran out"
                logger.warning("a new scheduler session %s; the previous one's state is dropped", how)
            self._session_id = request.session_id
            self._heard_at = time.monotonic()
            self._num_claims += 1
            self._turn.notify_all()  # steps of a replaced session waiting for their turn fail now
            return reply

    async def Step(self, request, context):  # noqa: N802
        self._check_session(request.session_id)
        claim = self._num_claims
        async with self._turn:
            await self._turn.wait_for(lambda: self._num_claims != claim or self.core.next_step_id >= request.step_id)
            self._check_session(request.session_id)
            if self._num_claims != claim:
                raise SessionLostError("session: the worker was claimed again while this step waited; its state "
                                       "is gone")
            try:
                pending = await self._on_model_thread(self.core.launch, request)  # raises StepOrderError
            finally:
                # The next step may launch now, while this one runs on the GPU.
                self._turn.notify_all()
        return await asyncio.to_thread(pending.result)

    async def Release(self, request, context):  # noqa: N802
        self._check_session(request.session_id)
        async with self._turn:
            self._check_session(request.session_id)
            # On the model thread: the core's lock may be held by a step being launched, and the event
            # loop must never wait for it (heartbeats are answered there).
            return await self._on_model_thread(self.core.release, request)

    async def Heartbeat(self, request, context):  # noqa: N802
        # Answered on the event loop, never behind model work: a busy worker still answers at once.
        self._check_session(request.session_id)
        return worker_pb2.HeartbeatResponse()

    async def EndSession(self, request, context):  # noqa: N802
        self._check_session(request.session_id)
        async with self._turn:
            self._check_session(request.session_id)
            # The next claim, by any session, starts the worker over (InitCache forgets every sequence).
            self._session_id = None
            self._num_claims += 1
            self._turn.notify_all()
        logger.info("the scheduler session ended; the worker is free for the next scheduler")
        return worker_pb2.EndSessionResponse()


def server_credentials_for(link: WorkerLinkConfig) -> grpc.ServerCredentials | None:
    """TLS (mutual when link.tls_ca is set) from the link's files; None for plaintext."""
    if not link.tls_cert:
        if link.tls_ca:
            raise ValueError("tls_client_ca: needs --tls-cert and --tls-key")
        return None
    return server_credentials(link.tls_cert, link.tls_key, link.tls_ca or None)


async def serve_worker(core: WorkerCore | TensorParallelCore, model_thread: ThreadPoolExecutor, host: str,
                       port: int, link: WorkerLinkConfig) -> tuple[grpc.aio.Server, int]:
    """Starts the worker's server; returns it and the bound port. Raises PortInUseError when the
    address is taken (SO_REUSEPORT is off, so a second worker cannot share a port)."""
    credentials = server_credentials_for(link)
    install_grpc_log_filter()  # no client-sent bytes in grpcio's log records, in-process workers too
    server = new_server(STATUSES, BearerTokenInterceptor(accepts_secret(link.secret), SECRET_REFUSAL))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(core, model_thread, link.session_lease_s), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = listen(server, host, port, credentials, WORKER_PORT_IN_USE)
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("worker listening on %s%s", grpc_address(host, bound), " (TLS)" if credentials is not None else "")
    return server, bound
