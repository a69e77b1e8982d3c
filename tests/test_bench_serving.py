"""bench/serving.py at tiny scale against the real CPU services: the JSON's counts and the plot
(timings are not asserted: they depend on the machine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


# --- options: defaults shown, optional dependencies checked first, TLS and API keys ----------------------


def test_help_shows_the_defaults() -> None:
    result = subprocess.run([sys.executable, "bench/serving.py", "--help"], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    for shown in ("(default: 127.0.0.1:50051)", "(default: 4,8,16,32,inf)", "requests per rate (default: 256)",
                  "(default: 0.6)", "--ca-cert", "--api-key-file", "$NANOVLLM_API_KEY"):
        assert shown in text, shown
    assert "(default: None)" not in text  # those options say what leaving them out means


def test_missing_matplotlib_for_plot_stops_before_the_run(monkeypatch, capsys, tmp_path: Path) -> None:
    import importlib.util

    import bench.serving as serving

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    monkeypatch.setattr(serving, "run", lambda args: pytest.fail("the benchmark ran"))
    # Nothing listens at the target: the check comes before any connection.
    assert serving.main(["--target", f"127.0.0.1:{free_port()}", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err == ("bench/serving.py: --plot needs matplotlib, which is not installed: "
                   "pip install -e '.[bench]' (or pip install matplotlib)\n")
    assert not (tmp_path / "p.png").exists()


def test_api_key_from_the_file_or_the_environment(tmp_path: Path) -> None:
    from bench.serving import call_metadata, parse_args

    key_file = tmp_path / "key.txt"
    key_file.write_text("# the benchmark's key\n\n  key-from-file  \nsecond-key\n")
    assert call_metadata(parse_args(["--api-key-file", str(key_file)]), environ={"NANOVLLM_API_KEY": "env"}) == (
        ("authorization", "Bearer key-from-file"),)
    assert call_metadata(parse_args([]), environ={"NANOVLLM_API_KEY": " key-from-env\n"}) == (
        ("authorization", "Bearer key-from-env"),)
    assert call_metadata(parse_args([]), environ={}) == ()
    (tmp_path / "empty.txt").write_text("# none\n")
    with pytest.raises(ValueError, match=r"^--api-key-file: '.*empty.txt' holds no key$"):
        call_metadata(parse_args(["--api-key-file", str(tmp_path / "empty.txt")]), environ={})
    with pytest.raises(ValueError, match=r"^--api-key-file: cannot read '.*missing.txt'"):
        call_metadata(parse_args(["--api-key-file", str(tmp_path / "missing.txt")]), environ={})


def test_benchmark_of_a_service_with_tls_and_api_keys(tmp_path: Path, monkeypatch, capsys) -> None:
    from bench.serving import main
    from common.contract.config import PublicServerConfig
    from common.security.api_keys import ApiKeys
    from scheduler_service.api.tokenizer import load_tokenizer
    from tests.certificates import CertificateAuthority
    from tests.scheduler_service.public_server_harness import FakeEngine, ServerThread, save_tiny_tokenizer

    ca = CertificateAuthority("bench CA")
    issued = ca.issue("localhost", server=True)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "cert.pem").write_bytes(issued.cert)
    (tmp_path / "key.pem").write_bytes(issued.key)
    (tmp_path / "server_keys.txt").write_text("bench-key-0123456789\n")
    (tmp_path / "client_key.txt").write_text("bench-key-0123456789\n")
    config = PublicServerConfig(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"),
                                api_key_file=str(tmp_path / "server_keys.txt"), served_model_name="bench-model")
    engine = FakeEngine(load_tokenizer(str(save_tiny_tokenizer(tmp_path / "tokenizer"))))
    server = ServerThread(engine, config=config,
                          api_keys=ApiKeys.from_config(config.api_key_file, environ={})).start()
    monkeypatch.delenv("NANOVLLM_API_KEY", raising=False)
    target = f"localhost:{server.public.port}"  # the name the certificate holds
    common = ["--target", target, "--request-rates", "inf", "--num-prompts", "3", "--dataset", "fixed",
              "--input-len", "8", "--output-len", "3", "--single-stream-prompt-lens", "", "--num-warmup", "1",
              "--ready-timeout", "20"]
    json_out = tmp_path / "serving.json"
    try:
        assert main([*common, "--ca-cert", str(tmp_path / "ca.pem"), "--api-key-file",
                     str(tmp_path / "client_key.txt"), "--json-out", str(json_out)]) == 0
        results = json.loads(json_out.read_text())
        assert results["model"]["name"] == "bench-model"  # the served name
        (run,) = results["runs"]
        # The fake engine answers every request with three tokens.
        assert (run["num_requests"], run["num_completed"], run["num_failed"], run["output_tokens"]) == (3, 3, 0, 9)
        num_requests = len(engine.requests)
        assert num_requests == 1 + 3  # the warm-up and the measured ones

        monkeypatch.setenv("NANOVLLM_API_KEY", "bench-key-0123456789")
        assert main([*common, "--ca-cert", str(tmp_path / "ca.pem")]) == 0  # the key from the environment
        assert len(engine.requests) == num_requests + 4

        capsys.readouterr()
        monkeypatch.delenv("NANOVLLM_API_KEY")
        assert main([*common, "--ca-cert", str(tmp_path / "ca.pem")]) == 1
        assert capsys.readouterr().err == (
            "bench/serving.py: GetModelInfo: UNAUTHENTICATED: authorization: send 'authorization: Bearer <API key>' "
            "with a valid key (the service wants an API key: --api-key-file or $NANOVLLM_API_KEY)\n")
        assert len(engine.requests) == num_requests + 4  # refused: nothing ran
    finally:
        server.stop()
