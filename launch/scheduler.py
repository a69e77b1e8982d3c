"""`nanovllm scheduler`: the public gRPC server driving one worker, until SIGTERM or SIGINT.

On SIGTERM or SIGINT (the same): health turns NOT_SERVING and new requests get UNAVAILABLE; requests in flight have
--shutdown-grace seconds to finish; then the process exits.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

from common.contract.config import ObservabilityConfig, PublicServerConfig, SchedulerConfig, WorkerLinkConfig
from common.gc_pauses import freeze_startup_objects
from common.net.ports import PUBLIC_PORT_IN_USE, check_port_free
from common.security.api_keys import ApiKeys
from common.security.reloading_tls import check_readable
from scheduler_service.api.public_server import PublicServer, build_public_server
from scheduler_service.api.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.lanes.worker_client import GrpcWorkerClient
from scheduler_service.observe.load_report import LoadReport
from scheduler_service.observe.metrics import MetricsServer, ServiceMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerServiceConfig:
    """What `nanovllm scheduler` runs with: its configs, the workers' addresses (one lane each) and
    the tokenizer (None: the first worker's model path)."""

    scheduler: SchedulerConfig
    public: PublicServerConfig
    link: WorkerLinkConfig
    worker_addresses: tuple[str, ...]
    observability: ObservabilityConfig = ObservabilityConfig()
    tokenizer: str | None = None


async def run_scheduler_async(service: SchedulerServiceConfig, stop: asyncio.Event | None = None,
                              on_engine: Callable[[AsyncEngine], None] | None = None) -> None:
    """Serves until stop is set (or SIGTERM/SIGINT); on_engine sees the engine once it exists."""
    # SIGINT (Ctrl-C) and SIGTERM both drain, from the first moment: before the server is up they end
    # start-up at once (a bare SIGTERM would kill the process and orphan `serve`'s worker).
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    started = asyncio.create_task(_start(service, on_engine))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([started, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not started.done():
        started.cancel()
        stopped.cancel()
        logger.info("stopped during start-up")
        return
    engine, server, metrics_server = started.result()  # raises start-up errors (bad options, port in use)
    await stopped
    grace_s = service.public.shutdown_grace_s
    logger.info("draining: new requests get UNAVAILABLE, %.0f s for those in flight", grace_s)
    await server.set_not_serving()
    await engine.shutdown(grace_s)
    await server.stop(1.0)
    if metrics_server is not None:
        metrics_server.close()
    logger.info("scheduler stopped")


async def _start(service: SchedulerServiceConfig, on_engine: Callable[[AsyncEngine], None] | None,
                 ) -> tuple[AsyncEngine, PublicServer, MetricsServer | None]:
    public = service.public
    api_keys = ApiKeys.from_config(public.api_key_file)
    check_readable({"tls_cert": public.tls_cert, "tls_key": public.tls_key, "tls_client_ca": public.tls_client_ca})
    check_port_free(public.host, public.port, PUBLIC_PORT_IN_USE)  # now, not after waiting for a worker
    # One lane per worker address: data parallelism, a block pool per worker.
    workers = [GrpcWorkerClient(address, service.link) for address in service.worker_addresses]
    tokenizer_path = service.tokenizer or await _worker_model_path(workers[0])
    tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
    metrics = ServiceMetrics(recording=bool(service.observability.metrics_port))  # off: nobody could read them
    engine = await AsyncEngine.start(service.scheduler, workers, tokenizer, eos_token_ids(tokenizer_path, tokenizer),
                                     observer=metrics)
    metrics.set_load_source(lambda: LoadReport.of(engine.worker_stats()))
    if on_engine is not None:
        on_engine(engine)
    server = build_public_server(engine, public.host, public.port, config=public, api_keys=api_keys, metrics=metrics)
    await server.start()
    metrics_server = None
    if service.observability.metrics_port:
        metrics_server = MetricsServer(metrics.registry, public.host, service.observability.metrics_port)
        logger.info("Prometheus metrics on http://%s:%d/metrics", public.host, metrics_server.port)
    freeze_startup_objects()
    logger.info("scheduler listening on %s:%d (%s, %s; worker %s); health is SERVING once the worker is ready",
                public.host, server.port, "TLS" if public.tls_cert else "plaintext",
                "API keys required" if api_keys else "no API keys", ",".join(service.worker_addresses))
    return engine, server, metrics_server


async def _worker_model_path(worker: GrpcWorkerClient) -> str:
    """The worker's model path, for the tokenizer when --tokenizer is not given."""
    import grpc

    while True:
        try:
            return (await worker.describe()).model_name
        except grpc.aio.AioRpcError as error:
            logger.info("waiting for worker %s: %s", worker.address, error.code().name)
            await asyncio.sleep(1.0)


def run_scheduler(service: SchedulerServiceConfig) -> int:
    """Serves until SIGTERM or SIGINT; raises ValueError for bad settings, OSError for a taken port."""
    asyncio.run(run_scheduler_async(service))
    return 0
