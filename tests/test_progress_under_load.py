"""Progress under CPU contention: while two other processes keep both cores busy, many short greedy
streams of different lengths start, finish and are cancelled against a real worker and scheduler, and
a watchdog fails the test on any stream that goes STALL_S without a token. Afterwards nothing is left
unfinished, every KV block is back in the pool and the slowed worker was never declared lost (the
scheduler's /metrics says so)."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.client import GenerationClient
from tests.metrics_scrape import scrape, value
from tests.services_harness import free_port, start_scheduler, start_worker, stop, wait_until
from tests.test_worker_link import health
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

STALL_S = 10.0  # a stream without a token this long has stopped: decode steps take milliseconds here
NUM_STREAMS = 48
NUM_AT_ONCE = 8
BUSY_S = 300  # the busy processes end by themselves even if the test is killed
SPIN = f"import time\nend = time.time() + {BUSY_S}\nwhile time.time() < end: pass"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("load"), "qwen3", num_heads=8, num_kv_heads=4, head_dim=64,
                                hidden_size=512, intermediate_size=2048, num_layers=8, max_position_embeddings=1024)
    save_tiny_bpe_tokenizer(path)
    return path


class Watchdog:
    """Each stream's time of its last token, while it runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}

    def beat(self, stream: int) -> None:
        with self._lock:
            self._last[stream] = time.monotonic()

    def done(self, stream: int) -> None:
        with self._lock:
            self._last.pop(stream, None)

    def longest_silence(self) -> tuple[int | None, float]:
        now = time.monotonic()
        with self._lock:
            if not self._last:
                return None, 0.0
            stream, last = min(self._last.items(), key=lambda item: item[1])
        return stream, now - last


def run_stream(client: GenerationClient, watchdog: Watchdog, index: int) -> tuple[int, int | None, int]:
    """Stream `index`: 4 to 60 tokens, every fifth cancelled after a few; returns (index, where it was
    cancelled or None, the tokens it got)."""
    max_tokens = 4 + (index * 7) % 57
    cancel_after = 2 + index % 3 if index % 5 == 0 else None
    watchdog.beat(index)
    stream = client.stream(f"Request {index}: " + "the quick brown fox " * (1 + index % 9), temperature=0,
                           max_tokens=max_tokens, ignore_eos=True)
    num_tokens = 0
    try:
        for delta in stream:
            num_tokens += len(delta.token_ids)
            watchdog.beat(index)
            if cancel_after is not None and num_tokens >= cancel_after:
                stream.close()
                break
    finally:
        watchdog.done(index)
    return index, cancel_after, num_tokens


def test_streams_keep_moving_while_other_processes_load_every_core(model) -> None:
    worker_port, port, metrics_port = free_port(), free_port(), free_port()
    worker = start_worker(model, worker_port)
    scheduler = start_scheduler(worker_port, port, "--metrics-port", str(metrics_port))
    busy = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2)]
    try:
        wait_until(lambda: health(worker_port) == "SERVING", timeout=120, what="the worker")
        client = GenerationClient(f"127.0.0.1:{port}", timeout=300)
        client.wait_ready(timeout=120)
        watchdog = Watchdog()
        with ThreadPoolExecutor(NUM_AT_ONCE) as pool:
            futures = [pool.submit(run_stream, client, watchdog, index) for index in range(NUM_STREAMS)]
            while not all(future.done() for future in futures):
                stream, silent_s = watchdog.longest_silence()
                if silent_s >= STALL_S:
                    for process in (worker, scheduler):  # every thread's stack to the test's stderr
                        process.send_signal(signal.SIGUSR1)
                    pytest.fail(f"stream {stream} got no token for {silent_s:.1f} s")
                time.sleep(0.1)  # the watchdog's period
            results = [future.result() for future in futures]
        for index, cancel_after, num_tokens in results:
            expected = cancel_after if cancel_after is not None else 4 + (index * 7) % 57
            assert num_tokens >= expected if cancel_after is not None else num_tokens == expected, index
        client.close()
        wait_until(lambda: value(scrape(metrics_port), "nanovllm_num_requests_running") == 0, timeout=30,
                   what="nothing left running")
        samples = scrape(metrics_port)
        assert value(samples, "nanovllm_kv_cache_usage_ratio") == 0
        assert value(samples, "nanovllm_worker_recoveries_total") == 0  # the loaded worker was never declared lost
    finally:
        for process in busy:
            process.kill()
        stop(scheduler)
        stop(worker)
