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
