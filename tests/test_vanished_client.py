"""A client that vanishes (its process frozen with SIGSTOP: the socket open, the peer silent, as when
its host drops off the network) has its streams cancelled and their KV blocks freed within the
keepalive bound: KEEPALIVE_TIME_MS without a frame from it, then KEEPALIVE_TIMEOUT_MS for a ping's answer."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.client import GenerationClient
from common.net.grpc_options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from tests.services_harness import REPO_ROOT, InProcessScheduler, free_port, start_worker, stop, wait_until
from tests.test_worker_link import health
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer
from tests.vanishing_client import NUM_STREAMS

DOCUMENTED_BOUND_S = 30.0  # README, "Operating it"
MAX_TOKENS = 3900  # a minute or more of decoding on a CPU: the streams cannot end by themselves in the bound


def test_a_frozen_clients_streams_end_and_free_their_blocks_within_the_keepalive_bound(tmp_path: Path) -> None:
    assert (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 <= DOCUMENTED_BOUND_S
    model = make_tiny_checkpoint(tmp_path, "qwen3", num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=512,
                                 intermediate_size=2048, num_layers=8, max_position_embeddings=4096)
    save_tiny_bpe_tokenizer(model)
    port = free_port()
    worker = start_worker(model, port, "--max-model-len", "4096")
    scheduler = client = None
    try:
        wait_until(lambda: health(port) == "SERVING", timeout=120, what="the worker")
        scheduler = InProcessScheduler(model, port).start()
        GenerationClient(scheduler.target).wait_ready(timeout=60)
        client = subprocess.Popen([sys.executable, "-m", "tests.vanishing_client", scheduler.target, str(MAX_TOKENS)],
                                  stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                  env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert client.stdout is not None and client.stdout.readline() == "streaming\n"
        assert scheduler.engine.num_unfinished == NUM_STREAMS
        client.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        wait_until(lambda: scheduler.engine.num_unfinished == 0, timeout=120, what="the streams to end")
        took_s = time.monotonic() - frozen
        assert took_s <= DOCUMENTED_BOUND_S, f"the frozen client's streams ended {took_s:.1f} s after the freeze"
        (_, stats), = scheduler.engine.worker_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks  # every block back in the pool
    finally:
        if client is not None:
            client.kill()
            client.wait()
        if scheduler is not None:
            scheduler.stop()
        stop(worker)
