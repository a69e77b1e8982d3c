"""`nanovllm serve`: one worker process and the scheduler on this machine; stopping this process
stops both.

The worker gets a fresh random secret through its environment (never its argv, which `ps` shows),
and serve's environment without the scheduler's secrets (the API keys): a worker needs none of them.
If the worker process exits before it was ever ready, serve stops at once; if it exits later, its
requests wait --worker-timeout as with any lost worker, then serve stops. Either way serve exits
non-zero with the worker's last error line as its own last line.

The worker runs in a session of its own: Ctrl-C in a terminal signals the terminal's foreground
process group, which is serve alone, so serve drains exactly as on SIGTERM and stops the worker
after the drain (on every way out; on Linux the worker also gets SIGTERM if serve itself is killed).
A second SIGTERM or SIGINT during the drain stops both at once (exit status 1).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

from common.contract.config import (
    ObservabilityConfig,
    PublicServerConfig,
    SchedulerConfig,
    WorkerConfig,
    WorkerLinkConfig,
)
from common.contract.config_flags import to_argv
from common.net.ports import METRICS_PORT_IN_USE, PUBLIC_PORT_IN_USE, check_port_free, free_port
from common.security.api_keys import API_KEYS_ENV
from common.security.worker_secret import SECRET_ENV, new_secret
from launch.scheduler import STOPPED_AT_ONCE, SchedulerServiceConfig, run_scheduler_async
from scheduler_service.lanes.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# What serve's environment may hold that its worker must not: the public port's API keys, and the
# key a client on this shell would send (common.client's examples, bench/serving.py).
SCHEDULER_ONLY_ENV = (API_KEYS_ENV, "NANOVLLM_API_KEY")


def worker_environment(environ: Mapping[str, str], secret: str) -> dict[str, str]:
    """The worker's environment: environ without SCHEDULER_ONLY_ENV, with the worker secret (devices,
    caches, threads and the like pass unchanged)."""
    return {**{name: value for name, value in environ.items() if name not in SCHEDULER_ONLY_ENV},
            SECRET_ENV: secret}


def worker_command(config: WorkerConfig, observability: ObservabilityConfig, port: int) -> list[str]:
    """`nanovllm worker` with config's values (the module is named, not imported: no service imports the CLI)."""
    return [sys.executable, "-m", "launch.cli", "--log-level", observability.log_level,
            "--log-format", observability.log_format, "worker", "--host", "127.0.0.1", "--port", str(port),
            "--cpu-kv-cache-gb", str(config.cpu_kv_cache_bytes / 2**30), *to_argv(config)]


class WorkerStderr:
    """Forwards the worker's stderr to ours line by line, remembering its last non-empty line."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.last_line = ""
        self._process = process
        self._thread = threading.Thread(target=self._forward, name="worker-stderr", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        assert self._process.stderr is not None
        for line in self._process.stderr:
            sys.stderr.write(line)
            if line.strip():
                self.last_line = line.strip()

    def join(self) -> None:
        self._thread.join(timeout=5)


async def _serve_both(service: SchedulerServiceConfig, worker: subprocess.Popen,
                      stderr: WorkerStderr) -> tuple[int, str | None]:
    """Runs the scheduler until a signal or the worker's end; returns the scheduler's exit status and
    why serve failed, if it did."""
    stop = asyncio.Event()
    engines: list[AsyncEngine] = []
    failures: list[str] = []
    stopping = False  # serve itself stops the worker: its exit is no failure

    async def watch_worker() -> None:
        code = await asyncio.to_thread(worker.wait)
        if stopping:
            return
        await asyncio.to_thread(stderr.join)  # its last line is in
        failures.append(f"the worker exited with code {code}: {stderr.last_line}")
        if engines and engines[0].model_info is not None:  # it was serving: its requests get the timeout
            timeout_s = service.scheduler.worker_timeout_s
            logger.error("the worker exited with code %d; stopping in %g s (--worker-timeout)", code, timeout_s)
            await asyncio.sleep(timeout_s)
        stop.set()

    watcher = asyncio.create_task(watch_worker())
    status = STOPPED_AT_ONCE
    try:
        status = await run_scheduler_async(service, stop, engines.append)
    finally:
        stopping = True
        # Stopped here, so that the watcher's thread (in worker.wait) ends before the loop does.
        await asyncio.to_thread(_stop_worker, worker, 15 if status == 0 else 2)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return status, failures[0] if failures else None


def _stop_worker(worker: subprocess.Popen, timeout_s: float = 15) -> None:
    """SIGTERM (the worker stops its server), SIGKILL after timeout_s."""
    if worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def _worker_dies_with_serve() -> None:
    """In the worker's child process before exec: SIGTERM when serve's thread that started it ends,
    however serve ends (even SIGKILL), so that no worker outlives serve. Linux only (prctl)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def run_serve(config: WorkerConfig, scheduler: SchedulerConfig, public: PublicServerConfig,
              observability: ObservabilityConfig, tokenizer: str | None = None) -> int:
    """Runs a worker process with config and the scheduler with the rest until SIGTERM or SIGINT."""
    check_port_free(public.host, public.port, PUBLIC_PORT_IN_USE)  # before loading a model in the worker
    if observability.metrics_port:
        check_port_free(public.host, observability.metrics_port, METRICS_PORT_IN_USE)
    port = free_port()
    link = WorkerLinkConfig(new_secret())  # the worker inherits it through its environment
    service = SchedulerServiceConfig(scheduler, public, link, (f"127.0.0.1:{port}",), observability,
                                     tokenizer or config.model)
    logger.info("starting a worker for %s on 127.0.0.1:%d", config.model, port)
    # Its own session: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches serve only.
    # preexec_fn forks (no vfork): safe only while this process runs no gRPC yet, as here, before the
    # scheduler starts (with channels or servers running, grpcio >= 1.81 can kill the child before exec,
    # grpc/grpc#43055).
    worker = subprocess.Popen(worker_command(config, observability, port), stderr=subprocess.PIPE, text=True,
                              errors="replace", env=worker_environment(os.environ, link.secret),
                              start_new_session=True, preexec_fn=_worker_dies_with_serve)
    stderr = WorkerStderr(worker)
    status, failure = STOPPED_AT_ONCE, None
    try:
        status, failure = asyncio.run(_serve_both(service, worker, stderr))
    except KeyboardInterrupt:  # Ctrl-C before the scheduler's handlers were set: nothing served yet
        logger.info("stopped during start-up")
        status = 0
    finally:
        _stop_worker(worker, 15 if status == 0 else 2)
        stderr.join()  # the worker's last lines are out before serve's own end
    if failure is not None:
        print(f"nanovllm serve: {failure}", file=sys.stderr)
        return 1
    return status
