"""`--deterministic` on a GPU, end to end on a tiny random Qwen3 in bf16 (and with the FP8 cache):
greedy and seeded outputs are the same tokens whether a prompt runs alone, in one batch with the
others, among other prompts, in prefill chunks of 32 tokens, with a cached prefix, after
preemptions (a KV cache too small for the batch), CUDA graphs replaying decode batches of padded
sizes. (--enforce-eager swaps in other elementwise kernels: its outputs are as invariant, but its own.)

Random weights make near-ties common, so bf16 outputs without the mode differ between these runs
(bench/batch_invariance.py measures it on real weights); the kernels' own invariance checks are in
test_triton_invariant.py.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.contract.sampling_params import SamplingParams
from offline.llm import LLM
from tests.tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("det"), "qwen3", seed=5, num_heads=4, num_kv_heads=2,
                                head_dim=128, hidden_size=256, intermediate_size=768, tie=True,
                                max_position_embeddings=512)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts of 5 to 200 tokens, greedy and seeded in turn, plus a repeat of the first (a prefix hit)."""
    rng = random.Random(9)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(5, 200))] for _ in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(8)]
    return prompts + prompts[:1], params + params[:1]


def generate(checkpoint: Path, kv_cache_dtype: str, batches: list[list[int]], **options) -> dict[int, list[int]]:
    """Tokens per prompt index, the prompts run in the given batches (lists of indexes) one after another;
    extra prompts (index -1: random noise prompts) run beside them where a batch lists them."""
    prompts, params = workload()
    noise = random.Random(1)
    settings = dict(device="cuda", dtype="bfloat16", max_model_len=512, block_size=16, num_kv_blocks=512,
                    max_num_seqs=32, max_num_batched_tokens=1024, deterministic=True,
                    kv_cache_dtype=kv_cache_dtype) | options
    tokens: dict[int, list[int]] = {}
    with LLM(str(checkpoint), **settings) as llm:
        for batch in batches:
            batch_prompts = [prompts[i] if i >= 0 else [noise.randrange(512) for _ in range(noise.randint(3, 300))]
                             for i in batch]
            batch_params = [params[i] if i >= 0 else SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS + 9)
                            for i in batch]
            for index, out in zip(batch, llm.generate(batch_prompts, batch_params, use_tqdm=False), strict=True):
                if index >= 0:
                    tokens[index] = out["token_ids"]
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_outputs_do_not_depend_on_the_batch(checkpoint: Path, kv_cache_dtype: str) -> None:
    every = list(range(9))
    alone = generate(checkpoint, kv_cache_dtype, [[i] for i in every])
    assert len({tuple(t) for t in alone.values()}) >= 6  # mostly distinct answers (the ninth repeats the first)
    runs = {
        "together": generate(checkpoint, kv_cache_dtype, [every]),
        "among others": generate(checkpoint, kv_cache_dtype, [[-1, 3, -1, -1, 0, 5], [7, -1, 1, 2, -1, 4, 6, 8]]),
        "prefill chunks of 32": generate(checkpoint, kv_cache_dtype, [every], max_num_batched_tokens=32),
        "preempted (24 KV blocks)": generate(checkpoint, kv_cache_dtype, [every], num_kv_blocks=24),
    }
    for name, tokens in runs.items():
        differing = [i for i in every if tokens[i] != alone[i]]
        assert not differing, f"{name}: prompts {differing} differ from their runs alone"
