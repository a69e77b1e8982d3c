"""Liveness and leases on the worker link, against real worker processes: a frozen worker (SIGSTOP)
is lost within --worker-liveness-timeout and taken back after SIGCONT with its requests recomputed
exactly; a busy one (a long prefill) is not lost; a scheduler session is a lease: a clean stop ends
it, a vanished scheduler's lapses, a live one's is never taken without --worker-takeover."""
from __future__ import annotations

import logging
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common import SamplingParams
from common.client import GenerationClient
from common.contract.config import SchedulerConfig
from offline import LLM
from tests.services_harness import (
    InProcessScheduler,
    free_port,
    start_scheduler,
    start_worker,
    stop,
    wait_until,
)
from tests.test_worker_link import health
from tests.tiny_models import make_slow_cpu_checkpoint

PROMPTS = [f"Request {i}: the quick brown fox" for i in range(8)]
MAX_TOKENS = 48
LONG_PROMPT = [5 + i % 400 for i in range(3000)]  # seconds of prefill on a CPU
LANE_LOGGER = "scheduler_service.lanes.worker_lane"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_slow_cpu_checkpoint(tmp_path_factory.mktemp("liveness"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def undisturbed(model: Path) -> list[list[int]]:
    llm = LLM(str(model), block_size=16, num_kv_blocks=256, device="cpu")
    results = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    return [result["token_ids"] for result in results]


def started_worker(model: Path, *extra: str, **popen) -> tuple[int, subprocess.Popen]:
    port = free_port()
    process = start_worker(model, port, "--max-model-len", "4096", *extra, **popen)
    wait_until(lambda: health(port) == "SERVING", timeout=120, what="the worker")
    return port, process


def stream_all(client: GenerationClient) -> tuple[list, list]:
    """Starts a greedy stream per prompt; returns each one's first delta (so all are running) and the streams."""
    streams = [client.stream(p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
    return [next(stream) for stream in streams], streams


def finish(firsts: list, streams: list) -> list[list[int]]:
    def tokens(i: int) -> list[int]:
        return [t for delta in [firsts[i], *streams[i]] for t in delta.token_ids]

    with ThreadPoolExecutor(len(streams)) as pool:
        return list(pool.map(tokens, range(len(streams))))


def lost_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LANE_LOGGER and "recomputed" in r.getMessage()]


def test_a_frozen_worker_is_lost_within_the_bound_and_taken_back_after_it_resumes(model, undisturbed,
                                                                                  caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LANE_LOGGER)
    port, process = started_worker(model)
    scheduler = InProcessScheduler(model, port).start()  # the default --worker-liveness-timeout
    client = GenerationClient(scheduler.target, timeout=300)
    try:
        client.wait_ready(timeout=120)
        firsts, streams = stream_all(client)
        process.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        wait_until(lambda: not scheduler.engine.is_ready, timeout=30, what="the frozen worker counted as lost")
        noticed_s = time.monotonic() - frozen
        bound_s = SchedulerConfig().worker_liveness_s
        assert noticed_s <= bound_s + 0.5, f"noticed {noticed_s:.1f} s after the freeze"
        wait_until(lambda: any("answered no heartbeat for 5 s" in m for m in lost_messages(caplog)), timeout=5,
                   what="the loss logged with its reason")
        wait_until(lambda: health(scheduler.public.port) == "NOT_SERVING", timeout=5, what="health NOT_SERVING")
        process.send_signal(signal.SIGCONT)
        assert finish(firsts, streams) == undisturbed  # recomputed from the tokens the scheduler holds
        assert scheduler.engine.is_ready
    finally:
        process.send_signal(signal.SIGCONT)
        client.close()
        scheduler.stop()
        stop(process)


def test_a_worker_busy_with_a_long_prefill_is_not_lost(model, caplog) -> None:
    """The prefill takes seconds (4.7 s on the 2-core CI machine), three times the liveness bound: the
    worker answers heartbeats meanwhile."""
    caplog.set_level(logging.WARNING, logger=LANE_LOGGER)
    port, process = started_worker(model)
    scheduler = InProcessScheduler(model, port, SchedulerConfig(worker_liveness_s=1.5)).start()
    client = GenerationClient(scheduler.target, timeout=300)
    try:
        client.wait_ready(timeout=120)
        started = time.monotonic()
        result = client.generate(LONG_PROMPT, temperature=0, max_tokens=4, ignore_eos=True)
        took_s = time.monotonic() - started
        assert len(result.token_ids) == 4
        assert lost_messages(caplog) == [], f"a busy worker was declared lost (the call took {took_s:.1f} s)"
        assert scheduler.metrics is not None and scheduler.metrics.counters.worker_recoveries == 0
    finally:
        client.close()
        scheduler.stop()
        stop(process)


def test_a_clean_stop_ends_the_session_so_the_next_scheduler_attaches_at_once(model) -> None:
    """The worker's lease is a minute: only an ended session lets the next scheduler in within it."""
    port, process = started_worker(model, "--session-lease", "60")
    try:
        for _ in range(2):
            scheduler = InProcessScheduler(model, port).start()
            client = GenerationClient(scheduler.target, timeout=300)
            started = time.monotonic()
            client.wait_ready(timeout=120)
            assert time.monotonic() - started < 30
            assert client.generate(PROMPTS[0], temperature=0, max_tokens=4).token_ids
            client.close()
            scheduler.stop()
    finally:
        stop(process)


def test_a_killed_schedulers_session_lapses_and_a_live_ones_is_never_taken(model, undisturbed) -> None:
    lease_s = 2.0
    port, worker = started_worker(model, "--session-lease", str(lease_s), stderr=subprocess.PIPE, text=True)
    first_port, second_port = free_port(), free_port()
    first = start_scheduler(port, first_port)
    second = None
    try:
        first_client = GenerationClient(f"127.0.0.1:{first_port}", timeout=300)
        first_client.wait_ready(timeout=120)
        first.send_signal(signal.SIGKILL)
        first.wait()
        first_client.close()
        # A new scheduler claims the worker once the dead one's lease has run out.
        second = start_scheduler(port, second_port)
        client = GenerationClient(f"127.0.0.1:{second_port}", timeout=300)
        client.wait_ready(timeout=60)
        # A third, live scheduler beside it: refused for as long as the second lives, well past the lease.
        third = InProcessScheduler(model, port).start()
        try:
            firsts, streams = stream_all(client)
            time.sleep(3 * lease_s)  # the period the lease must hold through
            assert not third.engine.is_ready
            assert finish(firsts, streams) == undisturbed
        finally:
            third.stop()
        client.close()
    finally:
        for process in (first, second):
            if process is not None:
                stop(process)
        stop(worker)
    log = worker.stderr.read()
    assert f"claimed the worker after the previous session's lease ({lease_s:g} s) ran out" in log
    assert "took the worker over" not in log
