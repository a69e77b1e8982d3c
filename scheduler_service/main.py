"""`nanovllm scheduler`: the public gRPC server driving one worker, until SIGTERM or SIGINT.

On SIGTERM: health turns NOT_SERVING and new requests get UNAVAILABLE; requests in flight have
--shutdown-grace seconds to finish; then the process exits.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from common.cli import observability_config_from, scheduler_config_from
from common.gc_pauses import freeze_startup_objects
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.metrics import MetricsServer
from scheduler_service.public_server import build_public_server
from scheduler_service.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.worker_client import GrpcWorkerClient

logger = logging.getLogger(__name__)


async def run_scheduler_async(args: argparse.Namespace, tokenizer_path: str | None,
                              stop: asyncio.Event | None = None) -> None:
    config = scheduler_config_from(args)  # bad options fail here, before waiting for a worker
    observability = observability_config_from(args)
    # One lane per worker address: data parallelism, a block pool per worker.
    workers = [GrpcWorkerClient(address.strip()) for address in args.worker.split(",") if address.strip()]
    if tokenizer_path is None:
        tokenizer_path = await _worker_model_path(workers[0])
    tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
    engine = await AsyncEngine.start(config, workers, tokenizer,
                                     eos_token_ids(tokenizer_path, tokenizer))
    server = build_public_server(engine, args.host, args.port)
    await server.start()
    metrics_server = None
    if observability.metrics_port:
        metrics_server = MetricsServer(engine.metrics.registry, args.host, observability.metrics_port)
        logger.info("Prometheus metrics on http://%s:%d/metrics", args.host, metrics_server.port)
    freeze_startup_objects()
    logger.info("scheduler listening on %s:%d (worker %s); health is SERVING once the worker is ready",
                args.host, server.port, args.worker)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("draining: new requests get UNAVAILABLE, %.0f s for those in flight", args.shutdown_grace)
    await server.set_not_serving()
    await engine.shutdown(args.shutdown_grace)
    await server.stop(1.0)
    if metrics_server is not None:
        metrics_server.close()
    logger.info("scheduler stopped")


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
