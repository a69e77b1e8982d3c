"""Ctrl-C on `nanovllm serve` in a real terminal: serve runs in a pseudo-terminal as its session
leader and foreground process group, and the test types the interrupt character, so that the kernel
signals the whole foreground group as a terminal's Ctrl-C does. The worker, in its own session, must
not see it: the stream in flight finishes with all its tokens and status OK, and serve then stops the
worker. A second Ctrl-C during the drain stops at once: non-zero exit, one line saying so."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from common.client import GenerationClient
from tests.child_setup import with_controlling_terminal
from tests.services_harness import REPO_ROOT, free_port, run_cli, wait_until
from tests.tiny_models import make_tiny_checkpoint, save_tiny_bpe_tokenizer

CTRL_C = b"\x03"


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    """Big enough that a long generation takes seconds on a CPU."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("slow"), "qwen3", num_heads=8, num_kv_heads=4, head_dim=64,
                                hidden_size=512, intermediate_size=2048, num_layers=8, max_position_embeddings=1024)
    save_tiny_bpe_tokenizer(path)
    return path


class Terminal:
    """`nanovllm serve` in a pseudo-terminal; its output collected line by line."""

    def __init__(self, *args: str) -> None:
        master, slave = os.openpty()
        self.master = master
        # Its own session, whose controlling terminal is stdin, the pty's slave.
        self.process = subprocess.Popen(
            with_controlling_terminal([sys.executable, "-m", "launch.cli", "--log-level", "INFO", *args]),
            cwd=REPO_ROOT, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(slave)
        self._output = bytearray()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every slave end is closed
                return
            if not chunk:
                return
            with self._lock:
                self._output += chunk

    @property
    def output(self) -> str:
        with self._lock:
            return self._output.decode(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        wait_until(lambda: text in self.output or self.process.poll() is not None, timeout, repr(text))
        assert text in self.output, self.output

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def children(self) -> list[int]:
        """The pids whose parent is serve (its worker)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                    pids.append(int(entry))
        return pids

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=5)
        os.close(self.master)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def serve(model: Path, port: int, grace_s: int) -> Terminal:
    return Terminal("serve", "--model", str(model), "--port", str(port), "--device", "cpu", "--block-size", "16",
                    "--num-kv-blocks", "256", "--shutdown-grace", str(grace_s))


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and TIOCSCTTY")


def test_ctrl_c_in_a_terminal_drains_the_stream_then_stops_the_worker(slow_model: Path) -> None:
    port = free_port()
    terminal = serve(slow_model, port, grace_s=300)
    client = GenerationClient(f"127.0.0.1:{port}", timeout=300)
    try:
        client.wait_ready(timeout=240)
        (worker,) = terminal.children()
        # Long enough (seconds on this CPU) that the Ctrl-C typed after its first delta lands mid-stream.
        stream = client.stream("The quick brown fox", temperature=0, max_tokens=600, ignore_eos=True)
        deltas = [next(stream)]
        terminal.type(CTRL_C)
        terminal.wait_for("draining", timeout=30)
        assert not gone(worker)  # the terminal's SIGINT did not reach it
        deltas += list(stream)  # raises unless the status is OK
        assert sum(len(d.token_ids) for d in deltas) == 600
        assert deltas[-1].finish_reason == "length"
        assert terminal.process.wait(timeout=60) == 0
        assert gone(worker)
    finally:
        client.close()
        terminal.close()
    assert "Traceback" not in terminal.output and "worker lost" not in terminal.output


def test_a_second_ctrl_c_during_the_drain_stops_at_once(slow_model: Path) -> None:
    port = free_port()
    terminal = serve(slow_model, port, grace_s=600)
    client = GenerationClient(f"127.0.0.1:{port}", timeout=300)
    try:
        client.wait_ready(timeout=240)
        (worker,) = terminal.children()
        stream = client.stream("The quick brown fox", temperature=0, max_tokens=900, ignore_eos=True)
        next(stream)
        terminal.type(CTRL_C)
        terminal.wait_for("draining", timeout=30)
        started = time.monotonic()
        terminal.type(CTRL_C)
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.UNAVAILABLE, "the service is shutting down: the drain was cut short")
        assert terminal.process.wait(timeout=60) == 1
        assert time.monotonic() - started < 30  # far less than the 600 s grace
        assert gone(worker)
    finally:
        client.close()
        terminal.close()
    lines = [line for line in terminal.output.splitlines() if "during the drain" in line]
    assert len(lines) == 1 and "SIGINT during the drain: stopping now" in lines[0], terminal.output
    assert "Traceback" not in terminal.output


def test_serve_with_a_busy_metrics_port_stops_before_starting_its_worker(slow_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        result = run_cli("serve", "--model", str(slow_model), "--port", str(free_port()), "--device", "cpu",
                         "--metrics-port", str(busy), timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"nanovllm serve: metrics port 127.0.0.1:{busy} (--metrics-port) is in use by another process"]
