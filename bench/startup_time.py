"""Seconds from starting `nanovllm serve` (the default model, default options) to health SERVING,
polled from this process, with the service's own log lines on model load and KV cache.

    python bench/startup_time.py [--runs 3]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from common.client import GenerationClient  # noqa: E402
from tests.services_harness import free_port, stop  # noqa: E402

LOG_LINES = ("loaded in", "KV cache:", "health: SERVING")


def time_to_serving() -> tuple[float, list[str]]:
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a full pipe would stall the service
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--port", str(port)],
                                   cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            with GenerationClient(f"127.0.0.1:{port}") as client:
                client.wait_ready(timeout=300)
            seconds = time.perf_counter() - started
        finally:
            stop(process)
        log.seek(0)
        return seconds, [line.rstrip() for line in log if any(key in line for key in LOG_LINES)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs")
    for run in range(1, args.runs + 1):
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
        seconds, lines = time_to_serving()
        print(f"run {run}: SERVING {seconds:.1f} s after start (load average before: {load})")
        for line in lines:
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
