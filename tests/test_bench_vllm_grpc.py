"""bench/throughput.py's vllm-grpc mode at tiny scale on the CPU: the reference workload's token ids
through VllmEngine.Generate and through our Generate give the same output token counts (timings
are not asserted: they depend on the machine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.services_harness import REPO_ROOT
from tests.tiny_models import make_tiny_checkpoint

NUM_SEQS, MAX_INPUT_LEN, MAX_OUTPUT_LEN = 6, 24, 8


def test_vllm_grpc_mode_generates_the_workload_as_our_grpc_mode(tmp_path: Path) -> None:
    # The workload's ids go up to 10000: the vocabulary must hold them.
    model = make_tiny_checkpoint(tmp_path / "model", "qwen3", vocab_size=10240)
    json_out = tmp_path / "throughput.json"
    result = subprocess.run(
        [sys.executable, "bench/throughput.py", "--model", str(model), "--modes", "grpc,vllm-grpc",
         "--hf-num-seqs", "0", "--device", "cpu", "--num-seqs", str(NUM_SEQS), "--max-input-len", str(MAX_INPUT_LEN),
         "--max-output-len", str(MAX_OUTPUT_LEN), "--max-model-len", "256", "--block-size", "16",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--json-out", str(json_out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    results = json.loads(json_out.read_text())["results"]
    from bench.workload import bench_workload

    expected = sum(bench_workload(NUM_SEQS, MAX_INPUT_LEN, MAX_OUTPUT_LEN)[1])
    for mode in ("grpc", "vllm-grpc"):
        assert results[mode] is not None, result.stderr
        assert set(results[mode]) == {"all"}
        assert results[mode]["all"]["output_tokens"] == expected
    assert "VllmEngine.Generate / our Generate:" in result.stdout
