"""The worker's OpenMP wait policy: PASSIVE unless the environment chose one, set before torch loads
OpenMP (bench/results/2026-12-01-cpu-contention.md says why)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import worker
from tests.services_harness import REPO_ROOT


@pytest.mark.parametrize(("given", "expected"), [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"),
                                                 ({"GOMP_SPINCOUNT": "100000"}, None)])
def test_passive_unless_the_environment_chose(monkeypatch: pytest.MonkeyPatch, given: dict[str, str],
                                              expected: str | None) -> None:
    environment = {key: value for key, value in os.environ.items() if key not in worker.OPENMP_WAIT_SETTINGS}
    monkeypatch.setattr(os, "environ", {**environment, **given})  # put back after the test
    worker.sleep_at_openmp_barriers()
    assert os.environ.get("OMP_WAIT_POLICY") == expected


def test_the_worker_command_has_not_loaded_torch_when_it_sets_the_policy() -> None:
    """Everything `nanovllm worker` runs before run_worker (flags, the model's path) leaves torch unloaded."""
    code = ("import sys\nfrom launch import cli\n"
            "cli.checked_worker_config(cli.build_parser().parse_args(['worker', '--device', 'cpu']))\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
