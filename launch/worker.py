"""`nanovllm worker`: loads the model, serves Step RPCs until SIGTERM or SIGINT (the same)."""
from __future__ import annotations

import asyncio
import logging
import signal
import time

from common.contract.config import WorkerConfig, WorkerLinkConfig
from common.net.open_files import raise_open_file_limit
from common.net.ports import WORKER_PORT_IN_USE, check_port_free

logger = logging.getLogger(__name__)


async def _serve_worker(config: WorkerConfig, link: WorkerLinkConfig, host: str, port: int) -> None:
    from worker_service.api.server import model_thread, serve_worker
    from worker_service.runtime.tp_group import create_worker_core

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    check_port_free(host, port, WORKER_PORT_IN_USE)
    raise_open_file_limit()  # a connection holds a file: room for thousands of them
    started = time.perf_counter()
    model = model_thread()  # loads the model and runs it (see model_thread for why one thread)
    try:
        core = await loop.run_in_executor(model, create_worker_core, config)
        logger.info("model %s loaded in %.1f s", config.model, time.perf_counter() - started)
        server, port = await serve_worker(core, model, host, port, link)
        logger.info("worker ready on %s", host if host.startswith("/") else f"{host}:{port}")
        await stop.wait()
        logger.info("worker stopping")
        await server.stop(5)
        await loop.run_in_executor(model, core.close)
    finally:
        model.shutdown()


def run_worker(config: WorkerConfig, link: WorkerLinkConfig, host: str, port: int) -> int:
    """Serves Step RPCs on host:port (or the unix socket path host) until SIGTERM or SIGINT. A port in
    use raises PortInUseError (an OSError: the CLI prints it as one line, exit status 1)."""
    asyncio.run(_serve_worker(config, link, host, port))
    return 0
