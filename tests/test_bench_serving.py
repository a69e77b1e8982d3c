"""bench/serving.py at tiny scale against the real CPU services: the JSON's counts and the plot
(timings are not asserted: they depend on the machine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.services_harness import REPO_ROOT, free_port, start_scheduler, start_worker, stop
from tests.test_services_e2e import model_with_tokenizer

NUM_PROMPTS = 6
MAX_TOKENS = 5


def test_serving_benchmark_reports_every_rate_and_the_single_stream(tmp_path: Path) -> None:
    model = model_with_tokenizer(tmp_path / "model", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    worker_port, port = free_port(), free_port()
    worker = start_worker(model, worker_port)
    scheduler = start_scheduler(worker_port, port)
    json_out, plot = tmp_path / "serving.json", tmp_path / "serving.png"
    try:
        result = subprocess.run(
            [sys.executable, "bench/serving.py", "--target", f"127.0.0.1:{port}", "--request-rates", "50,inf",
             "--max-concurrency", "2", "--num-prompts", str(NUM_PROMPTS), "--dataset", "fixed", "--input-len", "20",
             "--output-len", str(MAX_TOKENS), "--single-stream-prompt-lens", "16,9000",
             "--single-stream-output-len", "4", "--single-stream-repeats", "2", "--num-warmup", "1",
             "--json-out", str(json_out), "--plot", str(plot), "--ready-timeout", "120"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    finally:
        stop(scheduler)
        stop(worker)
    assert result.returncode == 0, result.stderr
    results = json.loads(json_out.read_text())
    assert [run["request_rate"] for run in results["runs"]] == [50.0, "inf"]
    for run in results["runs"]:
        assert (run["num_requests"], run["num_completed"], run["num_failed"]) == (NUM_PROMPTS, NUM_PROMPTS, 0)
        assert (run["input_tokens"], run["output_tokens"]) == (20 * NUM_PROMPTS, MAX_TOKENS * NUM_PROMPTS)
        assert run["max_concurrency"] == 2 and 1 <= run["max_in_flight"] <= 2
        assert set(run["ttft_ms"]) == set(run["itl_ms"]) == set(run["e2e_ms"]) == {"mean", "p50", "p90", "p99"}
        assert 0 <= run["goodput_fraction"] <= 1
    # 9000 tokens do not fit the model's context: that point is skipped, not failed.
    assert [(s["prompt_len"], s["num_completed"]) for s in results["single_stream"]] == [(16, 2)]
    assert results["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rate (req/s) |" in result.stdout
    # The plot again from the JSON alone, as after a GPU run on a machine without matplotlib.
    replot = tmp_path / "replot.png"
    again = subprocess.run([sys.executable, "bench/serving.py", "--from-json", str(json_out), "--plot", str(replot)],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert replot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reference_workload_lengths_and_poisson_arrivals() -> None:
    from bench.serving import arrival_offsets, build_workload, parse_args

    args = parse_args(["--num-prompts", "64", "--max-input-len", "300", "--max-output-len", "200"])
    workload = build_workload(args, vocab_size=512)
    assert len(workload) == 64
    assert all(100 <= len(prompt) <= 300 and 100 <= max_tokens <= 200 for prompt, max_tokens in workload)
    assert all(0 <= token < 512 for prompt, _ in workload for token in prompt)
    assert arrival_offsets(5, float("inf"), seed=0) == [0.0] * 5
    offsets = arrival_offsets(1000, 10.0, seed=0)
    assert offsets == sorted(offsets) and offsets[0] == 0.0 and offsets == arrival_offsets(1000, 10.0, seed=0)
