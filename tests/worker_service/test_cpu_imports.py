"""A CPU worker never imports GPU code: the Triton backend and the fused-kernel compilation stay
unimported, so a machine without CUDA (or without triton) runs the worker."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiny_models import make_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def test_cpu_generation_imports_no_gpu_module(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path, "qwen3")
    code = "\n".join([
        "import sys",
        "from common import SamplingParams",
        "from offline import LLM",
        f"llm = LLM({str(model)!r}, block_size=16, num_kv_blocks=16, device='cpu')",
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)",
        "gpu = ['worker_service.attention.triton_backend', 'worker_service.attention.triton_decode',",
        "       'worker_service.attention.triton_prefill', 'worker_service.attention.triton_store_kv',",
        "       'worker_service.attention.triton_rope_store', 'worker_service.layers.triton_activation',",
        "       'worker_service.layers.triton_skinny_matmul']",
        "print(','.join(name for name in gpu if name in sys.modules))",
        "from worker_service.layers import cpu_kernels, norm",
        "print(norm.KERNELS['rms_norm'] is cpu_kernels.rms_norm)",  # the eager CPU kernel, nothing compiled
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert result.stdout.splitlines()[-2:] == ["", "True"]
