"""`nanovllm serve`: one worker process and the scheduler on this machine; stopping this process
stops both."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import subprocess
import sys

from scheduler_service.main import run_scheduler_async

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable, "-m", "common.cli", "--log-level", args.log_level, "worker",
        "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size),
        "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--cpu-kv-cache-gb", str(args.cpu_kv_cache_gb), "--num-kv-blocks", str(args.num_kv_blocks),
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]


def run_serve(args: argparse.Namespace) -> int:
    if not args.model:
        from common.default_model import default_model_path

        args.model = default_model_path()
    from common.cli import scheduler_config_from, worker_config_from

    # Bad options fail here, before anything starts.
    worker_config_from(args)
    scheduler_config_from(args)
    port = _free_port()
    args.worker = f"127.0.0.1:{port}"
    logger.info("starting a worker for %s on %s", args.model, args.worker)
    worker = subprocess.Popen(worker_command(args, port))
    try:
        asyncio.run(run_scheduler_async(args, args.tokenizer or args.model))
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
    return 0
