"""`nanovllm scheduler`: the public gRPC server driving one worker, until SIGTERM or SIGINT.

On SIGTERM or SIGINT (the same): health turns NOT_SERVING and new requests get UNAVAILABLE; requests in flight have
--shutdown-grace seconds to finish; then the process exits.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable

from common.cli import observability_config_from, public_server_config_from, scheduler_config_from, worker_link_from
from common.gc_pauses import freeze_startup_objects
from scheduler_service.api_keys import ApiKeys
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.metrics import MetricsServer
from scheduler_service.public_server import PublicServer, build_public_server, check_port_free
from scheduler_service.public_tls import check_readable
from scheduler_service.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.worker_client import GrpcWorkerClient

logger = logging.getLogger(__name__)


async def run_scheduler_async(args: argparse.Namespace, tokenizer_path: str | None,
                              stop: asyncio.Event | None = None,
                              on_engine: Callable[[AsyncEngine], None] | None = None) -> None:
    """Serves until stop is set (or SIGTERM/SIGINT); on_engine sees the engine once it exists."""
    # SIGINT (Ctrl-C) and SIGTERM both drain, from the first moment: before the server is up they end
    # start-up at once (a bare SIGTERM would kill the process and orphan `serve`'s worker).
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    started = asyncio.create_task(_start(args, tokenizer_path, on_engine))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([started, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not started.done():
        started.cancel()
        stopped.cancel()
        logger.info("stopped during start-up")
        return
    engine, server, metrics_server = started.result()  # raises start-up errors (bad options, port in use)
    await stopped
    logger.info("draining: new requests get UNAVAILABLE, %.0f s for those in flight", args.shutdown_grace)
    await server.set_not_serving()
    await engine.shutdown(args.shutdown_grace)
    await server.stop(1.0)
    if metrics_server is not None:
        metrics_server.close()
    logger.info("scheduler stopped")


async def _start(args: argparse.Namespace, tokenizer_path: str | None,
                 on_engine: Callable[[AsyncEngine], None] | None,
                 ) -> tuple[AsyncEngine, PublicServer, MetricsServer | None]:
    config = scheduler_config_from(args)  # bad options fail here, before waiting for a worker
    observability = observability_config_from(args)
    link = worker_link_from(args)
    public_config = public_server_config_from(args)
    api_keys = ApiKeys.from_config(public_config.api_key_file)
    check_readable({"tls_cert": public_config.tls_cert, "tls_key": public_config.tls_key,
                    "tls_client_ca": public_config.tls_client_ca})
    check_port_free(args.host, args.port)  # now, not after waiting for a worker
    # One lane per worker address: data parallelism, a block pool per worker.
    workers = [GrpcWorkerClient(address.strip(), link) for address in args.worker.split(",") if address.strip()]
    if tokenizer_path is None:
        tokenizer_path = await _worker_model_path(workers[0])
    tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
    engine = await AsyncEngine.start(config, workers, tokenizer,
                                     eos_token_ids(tokenizer_path, tokenizer))
    if on_engine is not None:
        on_engine(engine)
    server = build_public_server(engine, args.host, args.port, config=public_config, api_keys=api_keys)
    await server.start()
    metrics_server = None
    if observability.metrics_port:
        metrics_server = MetricsServer(engine.metrics.registry, args.host, observability.metrics_port)
        logger.info("Prometheus metrics on http://%s:%d/metrics", args.host, metrics_server.port)
    freeze_startup_objects()
    logger.info("scheduler listening on %s:%d (%s, %s; worker %s); health is SERVING once the worker is ready",
                args.host, server.port, "TLS" if public_config.tls_cert else "plaintext",
                "API keys required" if api_keys else "no API keys", args.worker)
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


def run_scheduler(args: argparse.Namespace) -> int:
    asyncio.run(run_scheduler_async(args, args.tokenizer))
    return 0
