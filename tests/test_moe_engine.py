"""Qwen3-MoE through the whole engine against transformers' greedy generate, token for token, on tiny
random checkpoints (float32, CPU): plain batches, prefix-cache hits, chunked prefill and preemption,
with the chosen experts' weights renormalised or not, and dense layers among the sparse ones; and a
worker over two processes (experts split between the ranks, gloo) generating what one process does."""
from __future__ import annotations

from pathlib import Path

import pytest

from common import SamplingParams
from offline import LLM
from tests.test_engine_parity import make_prompts, token_ids
from tests.tiny_models import hf_greedy_generate, make_tiny_checkpoint

NUM_NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
Case = tuple[Path, list[list[int]], list[list[int]]]  # checkpoint, prompts, transformers' continuations

MODELS = {
    # every layer sparse, top-2 of 8 renormalised (Qwen3-30B-A3B's routing)
    "moe-norm-all-sparse": dict(num_layers=2, norm_topk_prob=True),
    # top-3 of 8 not renormalised; layer 1 dense (mlp_only_layers)
    "moe-raw-top3-mlp-only": dict(num_layers=3, norm_topk_prob=False, num_experts_per_tok=3, mlp_only_layers=(1,)),
    # every second layer sparse (decoder_sparse_step): layer 0 dense, layer 1 sparse
    "moe-norm-sparse-step2": dict(num_layers=2, norm_topk_prob=True, decoder_sparse_step=2),
}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory) -> Case:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), "qwen3_moe", num_heads=4, num_kv_heads=2,
                                head_dim=16, hidden_size=64, seed=len(request.param), **MODELS[request.param])
    prompts = make_prompts(seed=len(request.param))
    return path, prompts, hf_greedy_generate(path, prompts, NUM_NEW_TOKENS)


def generate(case: Case, **options) -> LLM:
    """Generates the case's prompts with these engine options: the tokens equal transformers', and
    every KV block is back in the pool afterwards."""
    path, prompts, expected = case
    llm = LLM(str(path), **options)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.stats().num_free_kv_blocks == options["num_kv_blocks"]
    return llm


def test_greedy_batch_equals_transformers(case: Case) -> None:
    generate(case, block_size=16, num_kv_blocks=128)


def test_prefix_cache_hits_keep_outputs_exact(case: Case) -> None:
    path, prompts, expected = case
    llm = LLM(str(path), block_size=16, num_kv_blocks=128)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    hits_before = llm.engine.stats().num_prefix_hit_tokens
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert llm.engine.stats().num_prefix_hit_tokens - hits_before >= 5 * 32  # the shared 40-token prefix


def test_chunked_prefill_equals_transformers(case: Case) -> None:
    generate(case, block_size=16, num_kv_blocks=128, max_num_batched_tokens=24)


def test_preemption_equals_transformers(case: Case) -> None:
    llm = generate(case, block_size=16, num_kv_blocks=10)
    assert llm.engine.stats().num_preemptions > 0


# Few blocks (preemption) and 24-token steps (chunked prefill); the second call hits the prefix cache.
TP_OPTIONS = dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=24, device="cpu")


def generate_twice(path: Path, prompts: list[list[int]], **options) -> tuple[list[list[int]], LLM]:
    """The first prompt alone, then all (sharing its prefix): the tokens of both calls."""
    with LLM(str(path), **TP_OPTIONS, **options) as llm:
        first = token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
        return first + token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)), llm


def test_two_ranks_generate_as_one(tmp_path: Path) -> None:
    """Each rank holds 4 of the 8 experts of each sparse layer and the router; layer 1 is dense (its MLP
    split by rows and columns, as a dense model's)."""
    path = make_tiny_checkpoint(tmp_path, "qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                                num_layers=3, mlp_only_layers=(1,), seed=3)
    prompts = make_prompts(seed=3)
    expected, _ = generate_twice(path, prompts)
    tokens, llm = generate_twice(path, prompts, tensor_parallel_size=2)
    assert tokens == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().num_prefix_hit_tokens >= 5 * 32
