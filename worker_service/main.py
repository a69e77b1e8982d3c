"""`nanovllm worker`: loads the model, serves Step RPCs until SIGTERM or SIGINT."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

logger = logging.getLogger(__name__)


async def _serve(args: argparse.Namespace) -> None:
    from common.cli import worker_config_from
    from worker_service.server import serve_worker
    from worker_service.tp_group import create_worker_core

    if not args.model:
        from common.default_model import default_model_path

        args.model = default_model_path()
    started = time.perf_counter()
    core = await asyncio.to_thread(create_worker_core, worker_config_from(args))
    logger.info("model %s loaded in %.1f s", args.model, time.perf_counter() - started)
    server, port = await serve_worker(core, args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info("worker ready on %s", args.host if args.host.startswith("/") else f"{args.host}:{port}")
    await stop.wait()
    logger.info("worker stopping")
    await server.stop(5)
    core.close()


def run_worker(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0
