"""`nanovllm scheduler`: the public gRPC server driving one worker, until SIGTERM or SIGINT.

Start-up checks the flags and ports first, then listens at once: health is NOT_SERVING (and requests
get UNAVAILABLE "no worker is ready") until a worker is ready; without --tokenizer the tokenizer is
the worker's model's, loaded once the worker has told its path.

On SIGTERM or SIGINT (the same): health turns NOT_SERVING and new requests get UNAVAILABLE; requests in flight have
--shutdown-grace seconds to finish (then they end with UNAVAILABLE); then the process exits with status 0. A second
SIGTERM or SIGINT during the drain stops at once: what still runs gets UNAVAILABLE, one line says so, exit status 1.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

from common.contract.config import ObservabilityConfig, PublicServerConfig, SchedulerConfig, WorkerLinkConfig
from common.gc_pauses import freeze_startup_objects
from common.net.open_files import raise_open_file_limit
from common.net.ports import METRICS_PORT_IN_USE, PUBLIC_PORT_IN_USE, check_port_free
from common.net.server_watch import stopped_by_itself
from common.security.api_keys import ApiKeys
from common.security.reloading_tls import check_readable
from scheduler_service.api.public_server import PublicServer, build_public_server
from scheduler_service.api.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.lanes.worker_client import GrpcWorkerClient, WorkerClient
from scheduler_service.lanes.worker_wait import until_answered
from scheduler_service.observe.load_report import LoadReport
from scheduler_service.observe.metrics import ServiceMetrics
from scheduler_service.observe.metrics_server import MetricsServer

logger = logging.getLogger(__name__)
STOPPED_AT_ONCE = 1  # the exit status after a second signal cut the drain short
SERVER_STOPPED = 1  # the exit status after the public server stopped by itself (common/net/server_watch.py)


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


class _Signals:
    """SIGTERM and SIGINT (Ctrl-C), the same: the first sets stop (drain), a second one sets again."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.again = asyncio.Event()
        self.name = ""
        self.server_died = False  # the public server stopped by itself: stop, and exit with status 1
        for signum in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        if self.stop.is_set():  # draining already (after a signal, or serve's worker ended)
            self.name = signal.Signals(signum).name
            self.again.set()
        self.stop.set()


async def run_scheduler_async(service: SchedulerServiceConfig, stop: asyncio.Event | None = None,
                              on_engine: Callable[[AsyncEngine], None] | None = None) -> int:
    """Serves until stop is set (or SIGTERM/SIGINT), then drains; returns the exit status: 0, or
    STOPPED_AT_ONCE when a second signal cut the drain short. on_engine sees the engine once it exists."""
    # SIGINT (Ctrl-C) and SIGTERM both drain, from the first moment: before the server is up they end
    # start-up at once (a bare SIGTERM would kill the process and orphan `serve`'s worker).
    # The handlers stay until the loop closes: a signal while `serve` then stops its worker changes nothing.
    return await _serve_until_stopped(service, _Signals(stop or asyncio.Event()), on_engine)


async def _serve_until_stopped(service: SchedulerServiceConfig, signals: _Signals,
                 on_engine: Callable[[AsyncEngine], None] | None) -> int:
    stopped = asyncio.create_task(signals.stop.wait())
    # Checks, the engine (not started yet) and the servers: quick, they do not wait for a worker.
    try:
        engine, server, metrics_server = await _start(service)
    except BaseException:
        stopped.cancel()
        raise
    if on_engine is not None:
        on_engine(engine)
    watch = asyncio.create_task(_stop_if_the_server_dies(server, signals))
    try:
        return await _serve_then_drain(service, signals, stopped, engine, server, metrics_server)
    finally:
        watch.cancel()


async def _stop_if_the_server_dies(server: PublicServer, signals: _Signals) -> None:
    if await stopped_by_itself(server.server, signals.stop):
        logger.error("the public gRPC server stopped by itself (grpcio's serving loop failed on a call); exiting "
                     "with status 1 for a supervisor to start the scheduler again")
        signals.server_died = True
        signals.stop.set()


async def _serve_then_drain(service: SchedulerServiceConfig, signals: _Signals, stopped: asyncio.Task,
                            engine: AsyncEngine, server: PublicServer, metrics_server: MetricsServer | None) -> int:
    attached = asyncio.create_task(_attach(service, engine))
    await asyncio.wait([attached, stopped], return_when=asyncio.FIRST_COMPLETED)
    if attached.done() and attached.exception() is not None:  # e.g. the worker's model has no tokenizer
        stopped.cancel()
        await _close(engine, server, metrics_server, grace_s=0)
        raise attached.exception()  # type: ignore[misc]
    await stopped
    if not attached.done():
        attached.cancel()
        await asyncio.gather(attached, return_exceptions=True)
        logger.info("stopped during start-up (no worker was ready)")
        await _close(engine, server, metrics_server, grace_s=0)
        return SERVER_STOPPED if signals.server_died else 0
    grace_s = service.public.shutdown_grace_s
    logger.info("draining: new requests get UNAVAILABLE, %.0f s for those in flight", grace_s)
    await server.set_not_serving()
    drained = asyncio.create_task(engine.shutdown(grace_s))
    again = asyncio.create_task(signals.again.wait())
    await asyncio.wait([drained, again], return_when=asyncio.FIRST_COMPLETED)
    status = 0
    if not drained.done():
        logger.warning("%s during the drain: stopping now; %d requests in flight end with UNAVAILABLE",
                       signals.name, engine.num_unfinished)
        engine.cut_drain()
        status = STOPPED_AT_ONCE
    again.cancel()
    await drained
    await _close(engine, server, metrics_server, grace_s=1.0, drained=True)
    logger.info("scheduler stopped")
    return SERVER_STOPPED if signals.server_died else status


async def _close(engine: AsyncEngine, server: PublicServer, metrics_server: MetricsServer | None,
                 grace_s: float, drained: bool = False) -> None:
    if not drained:
        await engine.shutdown(0)
    await server.stop(grace_s)  # the streams just ended get their status
    if metrics_server is not None:
        await metrics_server.close()


async def _start(service: SchedulerServiceConfig) -> tuple[AsyncEngine, PublicServer, MetricsServer | None]:
    """Checks every flag and port first, then builds the engine (its lanes not started) and listens."""
    public, metrics_port = service.public, service.observability.metrics_port
    raise_open_file_limit()  # a connection holds a file: room for thousands of clients on each port
    api_keys = ApiKeys.from_config(public.api_key_file)
    check_readable({"tls_cert": public.tls_cert, "tls_key": public.tls_key, "tls_client_ca": public.tls_client_ca})
    check_port_free(public.host, public.port, PUBLIC_PORT_IN_USE)
    if metrics_port:
        check_port_free(public.host, metrics_port, METRICS_PORT_IN_USE)
    # One lane per worker address: data parallelism, a block pool per worker.
    workers = [GrpcWorkerClient(address, service.link) for address in service.worker_addresses]
    metrics = ServiceMetrics(recording=bool(metrics_port))  # off: nobody could read them
    engine = AsyncEngine.pending(service.scheduler, workers, observer=metrics if metrics.recording else None)
    metrics.set_load_source(lambda: LoadReport.of(engine.worker_stats()))
    try:
        server = build_public_server(engine, public.host, public.port, config=public, api_keys=api_keys,
                                     metrics=metrics)
    except BaseException:
        await engine.shutdown(0)
        raise
    await server.start()
    metrics_server = None
    try:
        if metrics_port:
            metrics_server = await MetricsServer.start(metrics.registry, public.host, metrics_port,
                                                       is_serving=lambda: server.is_serving,
                                                       model_name=server.servicer.served_model_name)
            logger.info("Prometheus metrics on http://%s:%d/metrics", public.host, metrics_server.port)
    except BaseException:  # taken since the check: one line all the same, nothing left running
        await _close(engine, server, None, grace_s=0)
        raise
    logger.info("scheduler listening on %s:%d (%s, %s; worker %s); health is SERVING once the worker is ready",
                public.host, server.port, "TLS" if public.tls_cert else "plaintext",
                "API keys required" if api_keys else "no API keys", ",".join(service.worker_addresses))
    return engine, server, metrics_server


async def _attach(service: SchedulerServiceConfig, engine: AsyncEngine) -> None:
    """Loads the tokenizer (the first worker's model's without --tokenizer) and starts the lanes."""
    tokenizer_path = service.tokenizer or await _worker_model_path(engine.lanes[0].worker)
    tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
    eos_ids = await asyncio.to_thread(eos_token_ids, tokenizer_path, tokenizer)
    engine.begin(tokenizer, eos_ids)
    freeze_startup_objects()


async def _worker_model_path(worker: WorkerClient) -> str:
    """The worker's model path, for the tokenizer when --tokenizer is not given."""
    return (await until_answered(worker.address, worker.uses_tls, worker.describe)).model_name


def run_scheduler(service: SchedulerServiceConfig) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status (run_scheduler_async). Raises ValueError
    for bad settings, OSError for a taken port."""
    return asyncio.run(run_scheduler_async(service))
