"""`nanovllm worker`: loads the model, serves Step RPCs until SIGTERM or SIGINT (the same)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

from common.contract.config import WorkerConfig, WorkerLinkConfig
from common.net.open_files import raise_open_file_limit
from common.net.ports import WORKER_PORT_IN_USE, check_port_free
from common.net.server_watch import stopped_by_itself

logger = logging.getLogger(__name__)
# Either one set by the user is their choice of how OpenMP threads wait (OMP_WAIT_POLICY=ACTIVE: a
# machine of the worker's own).
OPENMP_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


async def _serve_worker(config: WorkerConfig, link: WorkerLinkConfig, host: str, port: int) -> int:
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
        status = 0
        if await stopped_by_itself(server, stop):
            logger.error("the worker's gRPC server stopped by itself (grpcio's serving loop failed on a call); "
                         "exiting with status 1 for a supervisor to start the worker again")
            status = 1
        logger.info("worker stopping")
        await server.stop(5)
        await loop.run_in_executor(model, core.close)
        return status
    finally:
        model.shutdown()


def sleep_at_openmp_barriers() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment chose a policy. Threads that spin at OpenMP's
    barriers collapse when another process shares the cores (0.06 of their alone rate; sleeping ones
    keep 0.83-0.94, for 1.6-1.8x less alone: bench/results/2026-12-01-cpu-contention.md). OpenMP
    reads it once, when torch loads it: this must run before torch is imported."""
    if any(name in os.environ for name in OPENMP_WAIT_SETTINGS):
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if "torch" in sys.modules:
        logger.warning("OMP_WAIT_POLICY=PASSIVE set after torch was loaded: it has no effect")


def run_worker(config: WorkerConfig, link: WorkerLinkConfig, host: str, port: int) -> int:
    """Serves Step RPCs on host:port (or the unix socket path host) until SIGTERM or SIGINT; returns
    the exit status (1: the server stopped by itself, common/net/server_watch.py). A port in use
    raises PortInUseError (an OSError: the CLI prints it as one line, exit status 1)."""
    sleep_at_openmp_barriers()
    return asyncio.run(_serve_worker(config, link, host, port))
