"""The FP8 KV cache on a GPU, end to end on the tiny random checkpoints: teacher-forced bf16 logits
with kv_cache_dtype="fp8" against the same model with the bf16 cache, through the Triton store,
prefill (chunks over a cached prefix) and CUDA-graph decode kernels. The same measure as
bench/fp8_kv_quality.py, which reports it for the default model on the CPU."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from bench.fp8_kv_quality import compare
from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.test_gpu_model import MODELS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NUM_WINDOWS, WINDOW_LEN = 8, 240  # the tiny checkpoints take 256 positions


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory) -> Path:
    spec = dict(MODELS[request.param])
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), spec.pop("arch"), seed=7, **spec)


def test_fp8_cache_keeps_top1_and_perplexity(checkpoint: Path) -> None:
    """8 windows of 240 tokens (1,912 predictions): prefill chunks of 64, the last 48 positions of
    each window as graph-replayed decode steps."""
    rng = random.Random(11)
    windows = [[rng.randrange(512) for _ in range(WINDOW_LEN)] for _ in range(NUM_WINDOWS)]
    report = compare(str(checkpoint), windows, device="cuda", dtype="bfloat16", chunk_len=64,
                     num_decode_positions=48)
    print("\n".join(report.lines()))
    assert report.num_positions == NUM_WINDOWS * (WINDOW_LEN - 1)
    assert report.top1_agreement >= 0.98, report.lines()
    # Random weights make perplexities astronomical (1e80 on the H200), where a ratio of them is
    # ill-conditioned: compare the mean negative log-likelihoods (log perplexities) instead.
    assert abs(math.log(report.perplexity_fp8) / math.log(report.perplexity_auto) - 1) < 0.02, report.lines()
