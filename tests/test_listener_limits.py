"""The three listening ports of real processes, 5,000 idle TCP connections at a time: `nanovllm
scheduler`'s metrics and public ports and `nanovllm worker`'s port. Each process starts with the
usual soft open-file limit of 1,024, which it raises itself. Whatever the port, the connections cost
no thread and a real call on a new connection is answered; gRPC closes the idle ones at its handshake
timeout, the metrics port holds at most its connection limit."""
from __future__ import annotations

import resource
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.client import GenerationClient
from common.net.grpc_options import HANDSHAKE_TIMEOUT_MS
from scheduler_service.observe.http_listener import DEFAULT_LIMITS
from tests.idle_connections import IdleConnections, need_open_files, num_open_files, num_threads
from tests.services_harness import cli, free_port, start_worker, stop, wait_until, worker_describe
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

NUM_IDLE = 5_000
USUAL_SOFT_LIMIT = 1_024  # the soft limit most shells start with
CALL_BOUND_S = 10.0


@dataclass
class Services:
    worker_pid: int
    scheduler_pid: int
    ports: dict[str, int]  # "metrics", "public", "worker"

    def pid(self, port_name: str) -> int:
        return self.worker_pid if port_name == "worker" else self.scheduler_pid


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    need_open_files(NUM_IDLE + 500)  # the client ends, here
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * NUM_IDLE + 1_000:  # gRPC takes half the limit per address
        pytest.skip(f"the services need a hard open-file limit of {2 * NUM_IDLE + 1_000}; this machine's is {hard}")
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("model"), "qwen3")
    save_tiny_bpe_tokenizer(model)
    ports = {"worker": free_port(), "public": free_port(), "metrics": free_port()}
    worker = start_worker(model, ports["worker"], soft_open_file_limit=USUAL_SOFT_LIMIT)
    scheduler = cli("scheduler", "--worker", f"127.0.0.1:{ports['worker']}", "--port", str(ports["public"]),
                    "--metrics-port", str(ports["metrics"]), soft_open_file_limit=USUAL_SOFT_LIMIT)
    try:
        with GenerationClient(f"127.0.0.1:{ports['public']}", timeout=60) as client:
            client.wait_ready(timeout=120)
        yield Services(worker.pid, scheduler.pid, ports)
    finally:
        stop(scheduler)
        stop(worker)


def open_files_limits(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open-file limit in /proc/{pid}/limits")


def test_each_service_raises_its_soft_open_file_limit_to_the_hard_one(services: Services) -> None:
    for pid in (services.worker_pid, services.scheduler_pid):
        soft, hard = open_files_limits(pid)
        assert soft == hard > USUAL_SOFT_LIMIT, pid


def real_call(services: Services, port_name: str) -> None:
    """A call on a new connection to the port, as a client makes it."""
    port = services.ports[port_name]
    if port_name == "metrics":
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_BOUND_S) as response:
            assert response.status == 200 and b"nanovllm_num_requests_running" in response.read()
    elif port_name == "public":
        with GenerationClient(f"127.0.0.1:{port}", timeout=CALL_BOUND_S) as client:
            assert client.generate("hello", max_tokens=2, temperature=0).usage.completion_tokens >= 1
    else:
        assert worker_describe(port).block_size == 16


@pytest.mark.parametrize("port_name", ["metrics", "public", "worker"])
def test_5000_idle_connections_cost_no_thread_and_a_real_call_answers(services: Services, port_name: str) -> None:
    pid, port = services.pid(port_name), services.ports[port_name]
    real_call(services, port_name)  # warm: the threads a first call starts are not the connections'
    threads_before, files_before = num_threads(pid), num_open_files(pid)
    opened = time.monotonic()
    with IdleConnections(port, NUM_IDLE) as idle:
        if port_name == "metrics":  # at its limit, each new connection closes the one idle longest
            max_connections = DEFAULT_LIMITS.max_connections
            wait_until(lambda: idle.num_closed() >= NUM_IDLE - max_connections, timeout=60,
                       what="the connections beyond the metrics port's limit closed")
            assert num_open_files(pid) <= files_before + max_connections + 5
        else:  # gRPC sends its SETTINGS on every connection it accepts
            wait_until(lambda: idle.num_answered() == NUM_IDLE, timeout=60,
                       what=f"the {port_name} server answering every connection")
            assert num_open_files(pid) >= files_before + NUM_IDLE - 5
        threads_held = num_threads(pid)
        started = time.monotonic()
        real_call(services, port_name)
        call_s = time.monotonic() - started
        print(f"{port_name}: {NUM_IDLE} idle connections, threads {threads_before} -> {threads_held}, "
              f"open files {files_before} -> {num_open_files(pid)}, a real call {call_s:.2f} s")
        assert threads_held <= threads_before + 2  # a thread per connection would be thousands
        assert call_s < CALL_BOUND_S
        if port_name != "metrics":  # no TLS handshake, no HTTP/2 preface: closed at the handshake timeout
            handshake_s = HANDSHAKE_TIMEOUT_MS / 1000
            wait_until(lambda: idle.num_closed() == NUM_IDLE, timeout=handshake_s + 30,
                       what="the idle connections closed at the handshake timeout")
            assert time.monotonic() - opened >= handshake_s - 1
    wait_until(lambda: num_open_files(pid) <= files_before + 5, timeout=30, what="the connections' files closed")
