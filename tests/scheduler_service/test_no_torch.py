"""The scheduler service never imports torch: it runs on machines without it."""
from __future__ import annotations

import subprocess
import sys

MODULES = [
    "scheduler_service",
    "scheduler_service.lanes.async_engine",
    "scheduler_service.api.public_server",
    "launch.scheduler",
    "launch.serve",
    "common.client",
    "launch.cli",
]


def test_importing_scheduler_service_does_not_import_torch() -> None:
    code = "\n".join([
        "import sys",
        *[f"import {name}" for name in MODULES],
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))",
        "print(','.join(loaded))",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_loading_a_tokenizer_does_not_import_torch(tmp_path) -> None:
    from tests.scheduler_service.public_server_harness import save_tiny_tokenizer

    folder = save_tiny_tokenizer(tmp_path)
    code = "\n".join([
        "import sys",
        "from scheduler_service.api.tokenizer import load_tokenizer",
        f"tokenizer = load_tokenizer({str(folder)!r})",
        "assert tokenizer is not None",
        "print(','.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
