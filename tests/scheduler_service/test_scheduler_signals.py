"""`nanovllm scheduler` stops on SIGINT exactly as on SIGTERM, also while it is still starting
(waiting for its worker): exit status 0, no traceback. While its worker is not up it listens already:
health NOT_SERVING, requests UNAVAILABLE; the wait is logged on change, not at each retry. A busy
--metrics-port stops start-up before anything starts. Streams still running when the drain ends end
with UNAVAILABLE (the tests in tests/test_signals.py drive the same through a real terminal)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest

from common.client import GenerationClient
from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from common.security.worker_secret import SECRET_ENV
from launch import scheduler as scheduler_main
from scheduler_service.core.errors import EngineUnavailableError
from scheduler_service.lanes import worker_wait
from scheduler_service.lanes.async_engine import DRAIN_CUT, GRACE_ENDED, AsyncEngine
from tests.scheduler_service.test_async_engine import ScriptedWorker
from tests.services_harness import REPO_ROOT, WORKER_SECRET, free_port, run_cli


def start_scheduler_without_worker(port: int) -> subprocess.Popen:
    # No worker listens at port 1: the scheduler waits for it.
    return subprocess.Popen([sys.executable, "-m", "launch.cli", "scheduler", "--worker", "127.0.0.1:1",
                             "--port", str(port)], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, SECRET_ENV: WORKER_SECRET, "PYTHONUNBUFFERED": "1"})


def read_until(process: subprocess.Popen, text: str) -> list[str]:
    assert process.stderr is not None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"the process ended without logging {text!r}: {''.join(lines)}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_stops_the_scheduler(signum: signal.Signals) -> None:
    process = start_scheduler_without_worker(free_port())
    try:
        read_until(process, "waiting for worker 127.0.0.1:1")
        process.send_signal(signum)
        rest = process.stderr.read()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in rest and "stopped during start-up" in rest


def test_a_scheduler_without_worker_listens_and_is_not_serving() -> None:
    port = free_port()
    process = start_scheduler_without_worker(port)
    client = GenerationClient(f"127.0.0.1:{port}", timeout=10)
    try:
        read_until(process, "waiting for worker 127.0.0.1:1")
        assert client.health_status() == "NOT_SERVING"
        for call in (lambda: client.generate("hello", max_tokens=2), lambda: list(client.stream("hi", max_tokens=2)),
                     client.model_info, lambda: client.tokenize("hello")):
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert (error.value.code(), error.value.details()) == (grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        process.send_signal(signal.SIGTERM)
        rest = process.stderr.read()
        assert process.wait(timeout=30) == 0
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in rest


class FailingDescribes:
    """A worker whose describe fails with the given codes in turn, then answers."""

    address = "scripted"

    def __init__(self, codes: list[grpc.StatusCode]) -> None:
        self.codes = list(codes)
        self.worker = ScriptedWorker()

    async def describe(self) -> worker_pb2.DescribeResponse:
        if self.codes:
            code = self.codes.pop(0)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"{code.name} details")
        return await self.worker.describe()

    def __getattr__(self, name: str):
        return getattr(self.worker, name)


CODES = [grpc.StatusCode.UNAVAILABLE] * 5 + [grpc.StatusCode.DEADLINE_EXCEEDED] * 3 + [grpc.StatusCode.UNAVAILABLE] * 4


def waits_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.getMessage().startswith("waiting for worker")]


def test_the_lane_logs_its_wait_on_change(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(worker_wait, "RETRY_S", 0)
    caplog.set_level(logging.INFO)
    worker = FailingDescribes(CODES)

    async def scenario() -> None:
        engine = await AsyncEngine.start(SchedulerConfig(), worker, None)
        await engine.wait_ready(10)
        await engine.shutdown(0)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert worker.codes == []
    assert waits_logged(caplog) == ["waiting for worker scripted: UNAVAILABLE", "waiting for worker scripted: "
                                    "DEADLINE_EXCEEDED", "waiting for worker scripted: UNAVAILABLE"]


def test_the_tokenizer_wait_logs_on_change(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(worker_wait, "RETRY_S", 0)
    caplog.set_level(logging.INFO)
    worker = FailingDescribes(CODES)
    assert asyncio.run(asyncio.wait_for(scheduler_main._worker_model_path(worker), 30)) == "scripted"
    assert worker.codes == []
    assert len(waits_logged(caplog)) == 3


def test_a_busy_metrics_port_stops_start_up_at_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        result = run_cli("scheduler", "--worker", "127.0.0.1:1", "--port", str(free_port()),
                         "--metrics-port", str(busy), timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"nanovllm scheduler: metrics port 127.0.0.1:{busy} (--metrics-port) is in use by another process"]


class HeldWorker(ScriptedWorker):
    """A scripted worker whose steps never return: a request stays running."""

    def __init__(self) -> None:
        super().__init__()
        self.stepping = asyncio.Event()

    async def step(self, request, timeout_s=None):
        self.stepping.set()
        await asyncio.Event().wait()  # never set
        return await super().step(request, timeout_s)


async def run_until_drained(cut: bool) -> BaseException:
    worker = HeldWorker()
    engine = await AsyncEngine.start(SchedulerConfig(), worker, None)
    await engine.wait_ready(10)
    outputs = []

    async def consume() -> None:
        async for output in engine.generate([1, 2, 3], SamplingParams(max_tokens=100)):
            outputs.append(output)

    stream = asyncio.create_task(consume())
    await worker.stepping.wait()
    if cut:
        drain = asyncio.create_task(engine.shutdown(3600))
        while not engine._draining:
            await asyncio.sleep(0)
        engine.cut_drain()
        await drain
    else:
        await engine.shutdown(0)
    with pytest.raises(EngineUnavailableError) as error:
        await stream
    assert outputs == [] and engine.num_unfinished == 0
    assert all(stats.num_free_kv_blocks == stats.num_kv_blocks for _, stats in engine.worker_stats())
    return error.value


def test_a_stream_running_when_the_grace_ends_gets_unavailable() -> None:
    error = asyncio.run(asyncio.wait_for(run_until_drained(cut=False), 30))
    assert str(error) == GRACE_ENDED == "the service is shutting down: the drain's grace period ended"


def test_a_cut_drain_ends_running_streams_at_once_with_unavailable() -> None:
    error = asyncio.run(asyncio.wait_for(run_until_drained(cut=True), 30))
    assert str(error) == DRAIN_CUT


def test_a_pending_engine_is_not_ready_until_begin() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker()
        engine = AsyncEngine.pending(SchedulerConfig(), worker)
        assert not engine.is_ready and engine.model_info is None
        with pytest.raises(EngineUnavailableError, match="no worker is ready"):
            await anext(engine.generate([1], SamplingParams(max_tokens=1)))
        engine.begin(None, {7})
        await engine.wait_ready(10)
        assert engine.is_ready and 7 in engine.lanes[0].core.eos_token_ids
        await engine.shutdown(0)

    asyncio.run(asyncio.wait_for(scenario(), 30))
