"""The torch backend's SDPA variant (the CPU default with quantized weights) against the reference
eager formula: prefills, a chunk after a cached prefix, and decodes, with grouped-query heads."""
from __future__ import annotations

import torch

from worker_service.attention import default_backend_name, get_attention_backend
from worker_service.attention.base import AttentionMetadata

BLOCK_SIZE = 16


def _batch(query_lens: list[int], seq_lens: list[int], kv_heads: int, head_dim: int,
           generator: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Caches holding random K/V for every context position, each sequence in its own blocks."""
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = blocks_per_seq * len(seq_lens)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(len(seq_lens), blocks_per_seq)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),  # attend() reads no slots
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=BLOCK_SIZE,
        query_lens_host=query_lens, seq_lens_host=seq_lens)
    return metadata, k_cache, v_cache


def test_matches_the_eager_formula() -> None:
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = 6, 2, 32
    eager, sdpa = get_attention_backend("torch"), get_attention_backend("torch-sdpa")
    # A whole prompt, a chunk after a 40-token cached prefix (causal from its own positions, which the
    # eager formula aligns at the end of the context), one token after a prefix; then decodes only.
    for query_lens, seq_lens in (([37, 9, 1], [37, 49, 20]), ([1, 1], [33, 7])):
        metadata, k_cache, v_cache = _batch(query_lens, seq_lens, kv_heads, head_dim, generator)
        q = torch.randn(sum(query_lens), heads, head_dim, generator=generator)
        want = eager.attend(q, k_cache, v_cache, metadata, head_dim**-0.5)
        got = sdpa.attend(q, k_cache, v_cache, metadata, head_dim**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_default_is_sdpa_only_for_quantized_weights_on_cpus() -> None:
    assert default_backend_name(torch.device("cpu")) == "torch"
    assert default_backend_name(torch.device("cpu"), is_quantized=True) == "torch-sdpa"
    assert default_backend_name(torch.device("cuda"), is_quantized=True) == "triton"
