"""Starts the real services for end-to-end tests: worker processes through the `nanovllm` CLI, and
the scheduler either as a process or in this process (to read its block counts)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from common.contract.config import SchedulerConfig, WorkerLinkConfig
from common.generated.nanovllm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.security.worker_secret import SECRET_ENV, secret_metadata
from scheduler_service.api.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.lanes.async_engine import AsyncEngine
from scheduler_service.lanes.worker_client import GrpcWorkerClient
from scheduler_service.observe.metrics import ServiceMetrics
from tests.child_setup import with_open_file_limit
from tests.loop_thread import LoopThread, PublicServerThread

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_OPTIONS = ["--block-size", "16", "--num-kv-blocks", "256", "--device", "cpu"]
# The secret the test services share (through the environment, as a user would pass it).
WORKER_SECRET = "test-secret-0123456789abcdef"
LINK = WorkerLinkConfig(WORKER_SECRET)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def cli(*args: str, soft_open_file_limit: int | None = None, **popen) -> subprocess.Popen:
    """A `nanovllm` command as a process, started with this soft open-file limit if one is given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", SECRET_ENV: WORKER_SECRET}
    command = [sys.executable, "-m", "launch.cli", "--log-level", "WARNING", *args]
    if soft_open_file_limit is not None:
        command = with_open_file_limit(command, soft_open_file_limit)
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, **popen)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs a `nanovllm` command to its end, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=timeout, env={**os.environ, SECRET_ENV: WORKER_SECRET})


def start_worker(model: Path, port: int, *extra: str, **popen) -> subprocess.Popen:
    return cli("worker", "--model", str(model), "--port", str(port), *WORKER_OPTIONS, *extra, **popen)


def start_scheduler(worker_port: int, port: int, *extra: str, **popen) -> subprocess.Popen:
    return cli("scheduler", "--worker", f"127.0.0.1:{worker_port}", "--port", str(port), *extra, **popen)


def worker_describe(port: int) -> worker_pb2.DescribeResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=5,
                                                            metadata=secret_metadata(WORKER_SECRET))


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class InProcessScheduler(PublicServerThread):
    """The real AsyncEngine and public server on an event loop in a daemon thread."""

    def __init__(self, model: Path, worker_port: int, config: SchedulerConfig | None = None,
                 link: WorkerLinkConfig = LINK, worker_address: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.worker_address = worker_address or f"127.0.0.1:{worker_port}"
        self.config = config or SchedulerConfig()
        self.link = link
        self.engine: AsyncEngine | None = None
        self.metrics: ServiceMetrics | None = None

    def start(self) -> InProcessScheduler:
        self.loop_thread = LoopThread("scheduler")

        async def build() -> None:
            tokenizer = load_tokenizer(str(self.model))
            worker = GrpcWorkerClient(self.worker_address, self.link)
            self.metrics = ServiceMetrics()
            self.engine = await AsyncEngine.start(self.config, worker, tokenizer,
                                                  eos_token_ids(str(self.model), tokenizer), observer=self.metrics)
            await self.serve(self.engine, metrics=self.metrics)

        self.run(build())
        return self

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self.engine is not None and self.public is not None
            await self.public.set_not_serving()
            await self.engine.shutdown(grace_s=0)
            await self.public.stop(grace=None)

        self.run(shutdown())
        assert self.loop_thread is not None
        self.loop_thread.close()
