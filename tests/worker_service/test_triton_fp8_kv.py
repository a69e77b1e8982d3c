"""The Triton kernels with an fp8 (e4m3) KV cache: the stores quantize as kv_quant.quantize does,
and decode and prefill attention over an fp8 cache match a float64 reference over the dequantized
cache (cache * scale), with and without scales.

Runs on a CUDA device, or on the CPU through Triton's interpreter. The interpreter (Triton 3.6)
supports float8e4nv loads, stores and conversions, but its fp32 -> e4m3 rounding is not the GPU's
(and torch's) round-to-nearest-even: seen here, ties go away from zero, a round-up that carries into
the next power of two loses the carry (7.9 -> 4.0, not 8.0), and subnormals round differently. So
off the GPU the store tests check where values go, saturation and no NaN, and that at most 10 % of
values differ from torch's; on a GPU they require torch's result bit for bit. The attention tests
quantize their caches with torch, so the interpreter checks the fp8 reads exactly.
"""
from __future__ import annotations

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from tests.worker_service.test_triton_attention import (  # noqa: E402
    LOW,
    PagedBatch,
    assert_matches,
    make_batch,
    prefill_cases,
    random_lengths,
    reference,
    small,
)
from worker_service.attention.kv_quant import FP8_DTYPE, FP8_MAX, quantize  # noqa: E402
from worker_service.attention.triton_decode import choose_num_splits, paged_decode  # noqa: E402
from worker_service.attention.triton_prefill import paged_prefill  # noqa: E402
from worker_service.attention.triton_rope_store import rope_and_store  # noqa: E402
from worker_service.attention.triton_store_kv import store_kv  # noqa: E402

pytestmark = pytest.mark.gpu

# (k_scale, v_scale): none, powers of two (exact), and arbitrary ones.
SCALES = [(1.0, 1.0), (0.25, 2.0), (0.037, 0.61)]


def assert_quantized(stored: torch.Tensor, x: torch.Tensor, scale: float, what: str) -> None:
    """stored (fp8) is quantize(x, scale): bit for bit on a GPU; through the interpreter, also one
    e4m3 step away where x / scale lies exactly halfway between two e4m3 values."""
    expected = quantize(x, scale, FP8_DTYPE).float().cpu()
    got = stored.float().cpu()
    differs = got != expected
    if not INTERPRET or not differs.any():
        assert not differs.any(), f"{what}: {int(differs.sum())} values differ from torch's quantization"
        return
    # The interpreter's conversion flaws (see the module docstring) touch a few percent of values.
    assert differs.float().mean().item() < 0.1, f"{what}: {int(differs.sum())} of {differs.numel()} values differ"

def fp8_batch(batch: PagedBatch, k_scale: float, v_scale: float) -> tuple[PagedBatch, PagedBatch]:
    """The batch with its caches quantized to fp8, and the same batch over the dequantized caches
    (float32, what the reference attends over)."""
    k8, v8 = quantize(batch.k_cache, k_scale, FP8_DTYPE), quantize(batch.v_cache, v_scale, FP8_DTYPE)
    quantized = PagedBatch(batch.q, k8, v8, batch.block_tables, batch.seq_lens, batch.query_lens)
    dequantized = PagedBatch(batch.q, k8.float() * k_scale, v8.float() * v_scale, batch.block_tables,
                             batch.seq_lens, batch.query_lens)
    return quantized, dequantized


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_store_kv_quantizes_like_torch(k_scale: float, v_scale: float) -> None:
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 2, 64, small(90, 40)
    generator = torch.Generator().manual_seed(int(k_scale * 1000))
    k = (8 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)).to(DEVICE, LOW)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, LOW)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 1e-4, 0.0])  # saturates, saturates, subnormal, zero
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[1] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots.to(DEVICE), k_scale, v_scale)
    keep = slots >= 0
    for name, cache, new, scale in (("k", k_cache, k, k_scale), ("v", v_cache, v, v_scale)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        assert_quantized(flat[slots[keep].to(DEVICE)], new[keep.to(DEVICE)], scale, f"store {name}")
        assert not torch.isnan(flat.float()).any(), f"{name}: NaN stored (no saturation?)"
    # 1000 / scale is beyond e4m3's range for every scale here: saturated, not NaN.
    assert k_cache.view(-1, num_kv_heads, head_dim)[slots[0], 0, :2].float().tolist() == [FP8_MAX, -FP8_MAX]


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES[:2])
@pytest.mark.parametrize("has_norm", [True, False])
def test_rope_and_store_quantizes_what_it_stores_unquantized(k_scale: float, v_scale: float, has_norm: bool) -> None:
    """The fused kernel into an fp8 cache stores quantize() of what it stores into a LOW cache."""
    num_tokens, heads, kv_heads, head_dim, block_size, num_blocks = small(40, 12), 4, 2, 64, 16, 4
    generator = torch.Generator().manual_seed(3)
    qkv = (4 * torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=generator)).to(DEVICE, LOW)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    positions = torch.randint(0, 100, (num_tokens,), generator=generator).to(DEVICE)
    angles = torch.arange(128)[:, None] * torch.rand(head_dim // 2, generator=generator)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(DEVICE)
    norm = (1 + torch.rand(head_dim, generator=generator)).to(DEVICE, LOW) if has_norm else None
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = {}
    for dtype in (LOW, FP8_DTYPE):
        caches[dtype] = (torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE))
        q_out = rope_and_store(q, k, v, positions, cos, sin, *caches[dtype], slots, q_norm_weight=norm,
                               k_norm_weight=norm, k_scale=k_scale, v_scale=v_scale)
        if dtype == LOW:
            q_low = q_out
        else:
            assert torch.equal(q_out, q_low), "q does not depend on the cache dtype"
    for index, (name, scale) in enumerate((("k", k_scale), ("v", v_scale))):
        flat_low = caches[LOW][index].view(-1, kv_heads, head_dim)[slots]
        flat_fp8 = caches[FP8_DTYPE][index].view(-1, kv_heads, head_dim)[slots]
        assert_quantized(flat_fp8, flat_low, scale, f"rope+store {name}")


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("splits", ["one", "auto"])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_over_fp8_matches_dequantized_reference(k_scale: float, v_scale: float, splits: str,
                                                      group: int) -> None:
    seq_lens = [1, 16, 17, 63, 65, *random_lengths(3, 2, small(3000, 200), seed=group), 0]
    base = make_batch(seq_lens, [1] * len(seq_lens), block_size=16, num_heads=2 * group, num_kv_heads=2,
                      head_dim=64, dtype=LOW, seed=group)
    quantized, dequantized = fp8_batch(base, k_scale, v_scale)
    num_splits = 1 if splits == "one" else choose_num_splits(len(seq_lens), 2, max(seq_lens), DEVICE)
    scale = 64 ** -0.5
    out = torch.full_like(base.q, float("nan"))
    paged_decode(quantized.q, quantized.k_cache, quantized.v_cache, quantized.block_tables,
                 torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale, num_splits, out=out,
                 k_scale=k_scale, v_scale=v_scale)
    assert_matches(out, reference(dequantized, scale), base, f"fp8 decode splits={num_splits} group={group}")


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
def test_prefill_over_fp8_matches_dequantized_reference(k_scale: float, v_scale: float, dtype: torch.dtype) -> None:
    cases = prefill_cases(16)
    base = make_batch([p + n for p, n in cases], [n for _, n in cases], block_size=16, num_heads=4, num_kv_heads=2,
                      head_dim=64, dtype=dtype, seed=7)
    quantized, dequantized = fp8_batch(base, k_scale, v_scale)
    metadata = base.metadata()
    scale = 64 ** -0.5
    out = torch.full_like(base.q, float("nan"))
    paged_prefill(quantized.q, quantized.k_cache, quantized.v_cache, quantized.block_tables, metadata.seq_lens,
                  metadata.query_start_loc, metadata.max_query_len, scale, out=out, k_scale=k_scale,
                  v_scale=v_scale)
    assert_matches(out, reference(dequantized, scale), base, f"fp8 prefill {dtype}")
