"""A Qwen3-MoE worker over two processes (the experts split between the ranks, gloo) generates what one
process does, token for token, through preemption, chunked prefill and prefix-cache hits. (The
single-process MoE models against transformers: tests/test_engine_parity.py.)"""
from __future__ import annotations

from pathlib import Path

from offline import LLM
from tests.test_engine_parity import GREEDY, make_prompts, token_ids
from tests.tiny_models import make_tiny_checkpoint

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
