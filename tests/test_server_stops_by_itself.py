"""A gRPC server that stops by itself takes its process with it. grpcio 1.85's serving loop fails on
a call whose method path is not UTF-8 and then shuts the whole server down, before any interceptor
runs (outside our code); a process left running with no server would look alive to a supervisor
that only watches the process. So the scheduler and the worker exit with status 1 and one line that
says why (and never the path's bytes), and a supervisor (compose's restart policy, Kubernetes)
starts them again."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.raw_http2 import call
from tests.services_harness import REPO_ROOT, free_port, start_scheduler, start_worker, wait_until
from tests.test_worker_link import health
from tests.tiny_models import make_tiny_checkpoint

PATH = b"/nanovllm.generate.v1.TextGeneration/Generate\xff"  # what a client would not send by mistake


def stopped_with_reason(process: subprocess.Popen) -> str:
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("the process lived on after its gRPC server stopped")
    assert process.returncode == 1
    assert "\\xff" not in stderr and "\udcff" not in stderr
    return stderr


def test_the_scheduler_exits_when_its_public_server_stops_by_itself() -> None:
    port = free_port()
    scheduler = start_scheduler(free_port(), port, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: health(port) == "NOT_SERVING", timeout=60, what="the scheduler listening")
    call("127.0.0.1", port, PATH, [])
    assert "the public gRPC server stopped by itself" in stopped_with_reason(scheduler)


def test_the_worker_exits_when_its_server_stops_by_itself(tmp_path) -> None:
    model = make_tiny_checkpoint(tmp_path, "qwen3")
    port = free_port()
    worker = start_worker(model, port, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: health(port) == "SERVING", timeout=120, what="the worker")
    call("127.0.0.1", port, PATH.replace(b"generate.v1.TextGeneration/Generate", b"worker.v1.Worker/Step"), [])
    assert "the worker's gRPC server stopped by itself" in stopped_with_reason(worker)


def test_a_path_that_is_not_utf8_stops_a_bare_grpcio_server() -> None:
    """The grpcio behaviour the above guards against, shown on a bare server: while it holds, the
    guard is needed (when a grpcio release fixes it, this fails and the guard may go)."""
    code = ("import asyncio, grpc\nfrom tests.raw_http2 import call\n"
            "async def main():\n    server = grpc.aio.server()\n    port = server.add_insecure_port('127.0.0.1:0')\n"
            "    await server.start()\n    await asyncio.to_thread(call, '127.0.0.1', port, b'/x\\xff', [])\n"
            "    await asyncio.wait_for(server.wait_for_termination(), 10)\n"
            "try:\n    asyncio.run(main())\nexcept UnicodeDecodeError:\n    print('stopped by itself')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert "stopped by itself" in result.stdout, result.stderr[-2000:]
