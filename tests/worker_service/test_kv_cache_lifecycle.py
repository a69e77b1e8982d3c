"""A worker's KV cache is freed before the next one is allocated: a second InitCache (a scheduler
taking the worker over) needs its memory back, on a GPU nearly all of it."""
from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from common.contract.config import WorkerConfig
from tests.tiny_models import make_tiny_checkpoint
from worker_service.runtime.model_runner import ModelRunner


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_release_cache_leaves_no_reference_to_the_cache(tmp_path: Path, kv_cache_dtype: str) -> None:
    model = make_tiny_checkpoint(tmp_path, "qwen3")
    runner = ModelRunner(WorkerConfig(model=str(model), device="cpu", block_size=16, num_kv_blocks=8,
                                      kv_cache_dtype=kv_cache_dtype))
    runner.init_cache(8)
    held = [weakref.ref(runner.kv_cache)]
    if kv_cache_dtype == "fp8":
        held.append(weakref.ref(runner.kv_scales))
    runner.release_cache()
    gc.collect()
    assert [ref() for ref in held] == [None] * len(held)
    assert runner.init_cache(4) == 4
    assert runner.model.attention_layers()[0].k_cache.shape[0] == 4
