"""The FP8 KV cache on the CPU: the number format (kv_quant), the config and CLI option, the pool
holding twice the blocks per byte, and the torch backend storing fp8 and attending over it as over
the dequantized cache. Token-exact parity tests elsewhere keep the default (unquantized) cache."""
from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from worker_service.attention import get_attention_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import FP8_DTYPE, FP8_MAX, dequantize, kv_cache_torch_dtype, quantize
from worker_service.model_runner import KVCacheSpec


def test_quantize_saturates_and_rounds_to_e4m3() -> None:
    x = torch.tensor([1000.0, -1000.0, 448.0, 1.0, 0.3, 0.0, 2.0**-9])
    stored = quantize(x, 1.0, FP8_DTYPE)
    assert stored.dtype == FP8_DTYPE
    assert dequantize(stored, 1.0).tolist() == [FP8_MAX, -FP8_MAX, 448.0, 1.0, 0.3125, 0.0, 2.0**-9]
    assert dequantize(quantize(x, 4.0, FP8_DTYPE), 4.0)[3].item() == 1.0
    assert torch.equal(quantize(x, 4.0, torch.float32), x)  # not an fp8 cache: no scale, no clamp


def test_kv_cache_dtype_option() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    assert WorkerConfig(model="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        WorkerConfig(model="m", kv_cache_dtype="int8")


def test_fp8_block_holds_half_the_bytes_of_bf16() -> None:
    bf16 = KVCacheSpec(28, 256, 8, 128, torch.bfloat16)
    fp8 = KVCacheSpec(28, 256, 8, 128, FP8_DTYPE)
    assert bf16.bytes_per_block == 2 * fp8.bytes_per_block == 28 * 256 * 8 * 128 * 2 * 2


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.05, 0.5)])
def test_torch_backend_over_fp8_is_attention_over_the_dequantized_cache(k_scale: float, v_scale: float) -> None:
    """Two sequences (a chunk over a cached prefix, and a one-token decode) store K/V into an fp8
    cache; attention equals the same backend's over a float32 cache holding the dequantized values."""
    backend = get_attention_backend("torch")
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 8
    seq_lens, query_lens = [40, 21], [9, 1]
    tables = torch.tensor([[3, 5, 0], [6, 1, 0]], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k8 = torch.zeros(shape, dtype=FP8_DTYPE)
    v8 = torch.zeros(shape, dtype=FP8_DTYPE)
    # The whole context is written through store_kv, as prefill steps would have.
    slots = torch.cat([torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                                     for p in range(n)]) for s, n in enumerate(seq_lens)])
    k = 5 * torch.randn(len(slots), kv_heads, head_dim, generator=generator)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=generator)
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, 9, 10], dtype=torch.int32),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                                 max_query_len=9, max_seq_len=40, block_size=block_size,
                                 query_lens_host=query_lens, seq_lens_host=seq_lens)
    backend.store_kv(k, v, k8, v8, metadata, k_scale, v_scale)
    flat = k8.view(torch.uint8).view(-1, kv_heads, head_dim)[slots].view(FP8_DTYPE)
    assert torch.equal(flat.view(torch.uint8), quantize(k, k_scale, FP8_DTYPE).view(torch.uint8))
    k32, v32 = dequantize(k8, k_scale), dequantize(v8, v_scale)
    q = torch.randn(10, heads, head_dim, generator=generator)
    for is_decode_only in (False, True):
        md, qq = metadata, q
        if is_decode_only:  # the batched decode path: one token per sequence
            md = AttentionMetadata(slot_mapping=slots[:2], query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                                   seq_lens=md.seq_lens, block_tables=tables, max_query_len=1, max_seq_len=40,
                                   block_size=block_size, query_lens_host=[1, 1], seq_lens_host=seq_lens)
            qq = q[[8, 9]]
        got = backend.attend(qq, k8, v8, md, head_dim**-0.5, k_scale, v_scale)
        want = backend.attend(qq, k32, v32, md, head_dim**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
