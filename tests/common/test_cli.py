"""The `nanovllm` command line: bad option values get a one-line error naming the option."""
from __future__ import annotations

import pytest

from tests.services_harness import run_cli


@pytest.mark.parametrize(("args", "message"), [
    (["scheduler", "--worker", "127.0.0.1:1", "--num-decode-steps", "0"],
     "num_decode_steps: must be in [1, 64], got 0"),
    (["scheduler", "--worker", "127.0.0.1:1", "--max-num-seqs", "0"], "max_num_seqs: must be >= 1, got 0"),
    (["worker", "--model", "/nonexistent", "--block-size", "24"], "block_size: must be a power of two >= 16, got 24"),
    (["scheduler", "--worker", "127.0.0.1:1", "--metrics-port", "70000"],
     "metrics_port: must be in [0, 65535], got 70000"),
])
def test_bad_option_values_exit_2_naming_the_option(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == f"nanovllm {args[0]}: {message}"



def test_health_with_an_unreadable_tls_file_exits_2_naming_it(tmp_path) -> None:
    """The client reads its PEM files with common.security.tls, as the services do: a bad option, exit 2."""
    missing = tmp_path / "ca.pem"
    result = run_cli("health", "--target", "127.0.0.1:1", "--ca-cert", str(missing))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"nanovllm health: tls ca: cannot read '{missing}'")
    result = run_cli("health", "--target", "127.0.0.1:1", "--client-cert", str(missing))
    assert (result.returncode, result.stderr) == (2, "nanovllm health: tls cert and key: give both or neither\n")

def test_serve_hands_every_worker_field_to_its_worker_command(tmp_path) -> None:
    from common.contract.config import ObservabilityConfig, WorkerConfig
    from launch.cli import build_parser, worker_config
    from launch.serve import worker_command

    (tmp_path / "m.gguf").touch()  # worker_config checks that the model exists
    config = WorkerConfig(str(tmp_path / "m.gguf"), dtype="float16", device="cpu", block_size=32, max_model_len=77,
                          gpu_memory_utilization=0.5, cpu_kv_cache_bytes=3 << 28, num_kv_blocks=9, enforce_eager=True,
                          attention_backend="torch", kv_cache_dtype="fp8", seed=5, max_num_seqs=3,
                          max_num_batched_tokens=99, tensor_parallel_size=2, cpu_weight_format="int4")
    argv = worker_command(config, ObservabilityConfig(log_level="DEBUG"), 1234)
    args = build_parser().parse_args(argv[argv.index("launch.cli") + 1:])
    assert (worker_config(args), args.log_level, args.port) == (config, "DEBUG", 1234)


def test_todays_flag_spellings_reach_the_configs() -> None:
    from common.contract.config import PublicServerConfig, SchedulerConfig, WorkerLinkConfig
    from common.contract.config_flags import config_from
    from launch.cli import build_parser

    args = build_parser().parse_args(["scheduler", "--worker", "w:1", "--no-prefix-caching", "--worker-timeout", "5",
                                      "--worker-takeover", "--worker-tls-ca", "ca.pem", "--no-reflection",
                                      "--shutdown-grace", "2"])
    assert not config_from(SchedulerConfig, args).enable_prefix_caching
    assert config_from(SchedulerConfig, args).worker_timeout_s == 5
    link = config_from(WorkerLinkConfig, args, prefix="worker-", secret="s")
    assert (link.takeover, link.tls_ca) == (True, "ca.pem")
    public = config_from(PublicServerConfig, args)
    assert (public.reflection, public.shutdown_grace_s) == (False, 2)
    worker = build_parser().parse_args(["worker", "-tp", "2", "--tls-client-ca", "ca.pem"])
    assert (worker.tensor_parallel_size, config_from(WorkerLinkConfig, worker, secret="s").tls_ca) == (2, "ca.pem")


def test_no_service_imports_the_cli() -> None:
    import subprocess
    import sys

    code = "import sys, launch.serve, launch.worker; print('launch.cli' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
