"""`nanovllm serve`: one worker process and the scheduler on this machine; stopping this process
stops both.

The worker gets a fresh random secret through its environment (never its argv, which `ps` shows).
If the worker process exits before it was ever ready, serve stops at once; if it exits later, its
requests wait --worker-timeout as with any lost worker, then serve stops. Either way serve exits
non-zero with the worker's last error line as its own last line.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading

from common.worker_link import SECRET_ENV, new_secret
from scheduler_service.async_engine import AsyncEngine
from scheduler_service.main import run_scheduler_async
from scheduler_service.public_server import check_port_free

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable, "-m", "common.cli", "--log-level", args.log_level, "--log-format", args.log_format,
        "worker",
        "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size),
        "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--cpu-kv-cache-gb", str(args.cpu_kv_cache_gb), "--num-kv-blocks", str(args.num_kv_blocks),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]


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


async def _serve(args: argparse.Namespace, worker: subprocess.Popen, stderr: WorkerStderr) -> str | None:
    """Runs the scheduler until a signal or the worker's end; returns why serve failed, if it did."""
    stop = asyncio.Event()
    engines: list[AsyncEngine] = []
    failures: list[str] = []
    stopping = False  # serve itself stops the worker: its exit is no failure

    async def watch_worker() -> None:
        code = await asyncio.to_thread(worker.wait)
        if stopping or stop.is_set():  # Ctrl-C reaches the worker too: that exit is no failure
            return
        await asyncio.to_thread(stderr.join)  # its last line is in
        failures.append(f"the worker exited with code {code}: {stderr.last_line}")
        if engines and engines[0].model_info is not None:  # it was serving: its requests get the timeout
            logger.error("the worker exited with code %d; stopping in %g s (--worker-timeout)", code,
                         args.worker_timeout)
            await asyncio.sleep(args.worker_timeout)
        stop.set()

    watcher = asyncio.create_task(watch_worker())
    try:
        await run_scheduler_async(args, args.tokenizer or args.model, stop, engines.append)
    finally:
        stopping = True
        # Stopped here, so that the watcher's thread (in worker.wait) ends before the loop does.
        await asyncio.to_thread(_stop_worker, worker)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return failures[0] if failures else None


def _stop_worker(worker: subprocess.Popen) -> None:
    if worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(timeout=15)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def run_serve(args: argparse.Namespace) -> int:
    if not args.model:
        from common.default_model import default_model_path

        args.model = default_model_path()
    from common.cli import scheduler_config_from, worker_config_from

    # Bad options fail here, before anything starts.
    worker_config_from(args)
    scheduler_config_from(args)
    check_port_free(args.host, args.port)  # before loading a model in the worker
    port = _free_port()
    args.worker = f"127.0.0.1:{port}"
    # Our scheduler reads it from here; the worker inherits it.
    os.environ[SECRET_ENV] = new_secret()
    logger.info("starting a worker for %s on %s", args.model, args.worker)
    worker = subprocess.Popen(worker_command(args, port), stderr=subprocess.PIPE, text=True, errors="replace")
    stderr = WorkerStderr(worker)
    try:
        failure = asyncio.run(_serve(args, worker, stderr))
    finally:
        _stop_worker(worker)
    if failure is not None:
        print(f"nanovllm serve: {failure}", file=sys.stderr)
        return 1
    return 0
