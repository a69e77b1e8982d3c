"""`nanovllm scheduler` stops on SIGINT exactly as on SIGTERM, also while it is still starting
(waiting for its worker): exit status 0, no traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from common.security.worker_secret import SECRET_ENV
from tests.services_harness import REPO_ROOT, WORKER_SECRET, free_port


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_stops_the_scheduler(signum: signal.Signals) -> None:
    # No worker listens at port 1: the scheduler waits for it, logging each attempt.
    process = subprocess.Popen([sys.executable, "-m", "launch.cli", "scheduler", "--worker", "127.0.0.1:1",
                                "--port", str(free_port())], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, SECRET_ENV: WORKER_SECRET})
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "waiting for worker 127.0.0.1:1" in line:
                break
        process.send_signal(signum)
        rest = process.stderr.read()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in rest and "stopped during start-up" in rest
