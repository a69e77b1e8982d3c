"""`nanovllm worker`: loads the model, serves Step RPCs until SIGTERM or SIGINT (the same)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time

from common.config import WorkerConfig, WorkerLinkConfig

logger = logging.getLogger(__name__)


def check_port_free(host: str, port: int) -> None:
    """Raises PortInUseError now, before the model loads, when host:port is taken. (The bind
    itself checks again: this probe only makes the common case fast and quiet.)"""
    from worker_service.server import PortInUseError

    if host.startswith("/") or port == 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise PortInUseError(f"cannot listen on {host}:{port}: {os.strerror(error.errno or 0)}") from None


async def _serve(config: WorkerConfig, link: WorkerLinkConfig, host: str, port: int) -> None:
    from worker_service.server import serve_worker
    from worker_service.tp_group import create_worker_core

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    check_port_free(host, port)
    started = time.perf_counter()
    core = await asyncio.to_thread(create_worker_core, config)
    logger.info("model %s loaded in %.1f s", config.model, time.perf_counter() - started)
    server, port = await serve_worker(core, host, port, link)
    logger.info("worker ready on %s", host if host.startswith("/") else f"{host}:{port}")
    await stop.wait()
    logger.info("worker stopping")
    await server.stop(5)
    core.close()


def run_worker(config: WorkerConfig, link: WorkerLinkConfig, host: str, port: int) -> int:
    """Serves Step RPCs on host:port (or the unix socket path host) until SIGTERM or SIGINT."""
    from worker_service.server import PortInUseError

    try:
        asyncio.run(_serve(config, link, host, port))
    except PortInUseError as error:
        print(f"nanovllm worker: {error}", file=sys.stderr)
        return 1
    return 0
