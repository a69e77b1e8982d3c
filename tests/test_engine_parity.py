"""The whole engine (scheduler + worker through the Step messages) against transformers' greedy
generate, token for token, on tiny random checkpoints (dense, and mixtures of experts): plain, with
prefix-cache hits, chunked prefill, preemption, and block sizes 16 and 256."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from common import SamplingParams
from offline import LLM
from tests.tiny_models import hf_greedy_generate, make_tiny_checkpoint

NUM_NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
Case = tuple[Path, list[list[int]], list[list[int]]]  # checkpoint, prompts, transformers' continuations

MOE = dict(arch="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
MODELS = {
    "qwen3-h4-kv2-d16": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64),
    "qwen3-h8-kv2-d32": dict(arch="qwen3", num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128),
    "llama-h4-kv4-d32-tied": dict(arch="llama", num_heads=4, num_kv_heads=4, head_dim=32, hidden_size=128, tie=True),
    "llama-h8-kv1-d16": dict(arch="llama", num_heads=8, num_kv_heads=1, head_dim=16, hidden_size=96),
    # Qwen3-MoE (8 experts): every layer sparse, top-2 renormalised (Qwen3-30B-A3B's routing)
    "moe-norm-all-sparse": dict(MOE, num_layers=2, norm_topk_prob=True),
    # top-3 of 8 not renormalised; layer 1 dense (mlp_only_layers)
    "moe-raw-top3-mlp-only": dict(MOE, num_layers=3, norm_topk_prob=False, num_experts_per_tok=3,
                                  mlp_only_layers=(1,)),
    # every second layer sparse (decoder_sparse_step): layer 0 dense, layer 1 sparse
    "moe-norm-sparse-step2": dict(MOE, num_layers=2, norm_topk_prob=True, decoder_sparse_step=2),
}


def make_prompts(seed: int, vocab_size: int = 512) -> list[list[int]]:
    """Ten prompts of different lengths; the last four share a 40-token prefix with the first."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(5, 70))] for _ in range(6)]
    prefix = [rng.randrange(vocab_size) for _ in range(40)]
    prompts[0] = prefix + prompts[0][:10]
    prompts += [prefix + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    return prompts


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory) -> Case:
    spec = dict(MODELS[request.param])
    arch = spec.pop("arch")
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, seed=len(request.param), **spec)
    prompts = make_prompts(seed=len(request.param))
    return path, prompts, hf_greedy_generate(path, prompts, NUM_NEW_TOKENS)


def token_ids(results: list[dict]) -> list[list[int]]:
    return [r["token_ids"] for r in results]


def assert_generates_as_transformers(case: Case, **options) -> LLM:
    """Generates the case's prompts with these engine options: the tokens equal transformers', and
    every KV block is back in the pool afterwards."""
    path, prompts, expected = case
    llm = LLM(str(path), **options)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.stats().num_free_kv_blocks == options["num_kv_blocks"]
    return llm


def test_greedy_batch_equals_transformers(case) -> None:
    assert_generates_as_transformers(case, block_size=16, num_kv_blocks=128)


def test_prefix_cache_hits_keep_outputs_exact(case) -> None:
    path, prompts, expected = case
    llm = LLM(str(path), block_size=16, num_kv_blocks=128)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    hits_before = llm.engine.stats().num_prefix_hit_tokens
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    # The shared 40-token prefix: two full blocks of 16 for each of the five prompts that share it.
    assert llm.engine.stats().num_prefix_hit_tokens - hits_before >= 5 * 32


def test_chunked_prefill_equals_transformers(case) -> None:
    assert_generates_as_transformers(case, block_size=16, num_kv_blocks=128, max_num_batched_tokens=24)


def test_preemption_equals_transformers(case) -> None:
    llm = assert_generates_as_transformers(case, block_size=16, num_kv_blocks=12)
    assert llm.engine.stats().num_preemptions > 0


def test_block_size_256_equals_transformers(case) -> None:
    assert_generates_as_transformers(case, block_size=256, num_kv_blocks=4)


def test_single_iteration_decode_steps_equal_transformers(case) -> None:
    assert_generates_as_transformers(case, block_size=16, num_kv_blocks=128, num_decode_steps=1)


def test_eight_iteration_decode_steps_with_preemption_equal_transformers(case) -> None:
    llm = assert_generates_as_transformers(case, block_size=16, num_kv_blocks=16, num_decode_steps=8)
    assert llm.engine.stats().num_preemptions > 0
