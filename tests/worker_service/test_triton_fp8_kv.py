"""The Triton kernels with an fp8 (e4m3) KV cache: the stores quantize each head vector with its
own scale as kv_quant does, and decode and prefill attention over an fp8 cache match a float64
reference over the dequantized cache (values times their scales).

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
from worker_service.attention.kv_quant import (  # noqa: E402
    FP8_DTYPE,
    allocate_scales,
    dequantize,
    head_scales,
    quantize,
)
from worker_service.attention.triton_decode import choose_num_splits, paged_decode  # noqa: E402
from worker_service.attention.triton_prefill import paged_prefill  # noqa: E402
from worker_service.attention.triton_rope_store import rope_and_store  # noqa: E402
from worker_service.attention.triton_store_kv import store_kv  # noqa: E402

pytestmark = pytest.mark.gpu



def assert_quantized(stored: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """stored (fp8) and scales are kv_quant's quantization of x: bit for bit on a GPU; through the
    interpreter the scales exactly and at most 10 % of the values differently rounded."""
    want_scales = head_scales(x)
    assert torch.equal(scales.cpu(), want_scales.cpu()), f"{what}: scales differ"
    expected = quantize(x, want_scales).float().cpu()
    differs = stored.float().cpu() != expected
    if not INTERPRET:
        assert not differs.any(), f"{what}: {int(differs.sum())} values differ from torch's quantization"
    # The interpreter's conversion flaws (see the module docstring) touch a few percent of values.
    assert differs.float().mean().item() < 0.1, f"{what}: {int(differs.sum())} of {differs.numel()} values differ"


def worker_scales(cache_shape: tuple[int, ...], fill: float) -> torch.Tensor:
    """Scales of a cache [num_blocks, block_size, num_kv_heads, head_dim] laid out as the worker
    allocates them (kv_quant.allocate_scales), filled with fill."""
    num_blocks, block_size, num_kv_heads = cache_shape[:3]
    return allocate_scales(torch.empty, (num_blocks,), block_size, num_kv_heads, DEVICE).fill_(fill)


def fp8_batch(batch: PagedBatch) -> tuple[PagedBatch, tuple[torch.Tensor, torch.Tensor], PagedBatch]:
    """The batch with its caches quantized to fp8, their scales, and the same batch over the
    dequantized caches (float32, what the reference attends over)."""
    k_scale = worker_scales(batch.k_cache.shape, 0.0).copy_(head_scales(batch.k_cache))
    v_scale = worker_scales(batch.v_cache.shape, 0.0).copy_(head_scales(batch.v_cache))
    k8, v8 = quantize(batch.k_cache, k_scale), quantize(batch.v_cache, v_scale)
    quantized = PagedBatch(batch.q, k8, v8, batch.block_tables, batch.seq_lens, batch.query_lens)
    dequantized = PagedBatch(batch.q, dequantize(k8, k_scale), dequantize(v8, v_scale), batch.block_tables,
                             batch.seq_lens, batch.query_lens)
    return quantized, (k_scale, v_scale), dequantized


def test_store_kv_quantizes_like_torch() -> None:
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 3, 64, small(90, 40)
    generator = torch.Generator().manual_seed(1)
    k = (8 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)).to(DEVICE, LOW)
    v = (0.01 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator)).to(DEVICE, LOW)
    k[2, 1] = 0.0  # an all-zero head vector: scale 1, values 0
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[1] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    scales = [worker_scales(shape, -1.0) for _ in range(2)]
    store_kv(k, v, caches[0], caches[1], slots.to(DEVICE), scales[0], scales[1])
    keep = slots >= 0
    for index, (name, new) in enumerate((("k", k), ("v", v))):
        flat = caches[index].view(-1, num_kv_heads, head_dim)
        flat_scales = scales[index].reshape(-1, num_kv_heads)
        kept = slots[keep].to(DEVICE)
        assert_quantized(flat[kept], flat_scales[kept], new[keep.to(DEVICE)], f"store {name}")
        unwritten = torch.ones(flat_scales.shape[0], dtype=torch.bool)
        unwritten[slots[keep]] = False
        assert (flat_scales[unwritten.to(DEVICE)] == -1).all(), f"{name}: scales written outside the slots"
    assert scales[0].reshape(-1, num_kv_heads)[slots[2], 1].item() == 1.0


@pytest.mark.parametrize("has_norm", [True, False])
def test_rope_and_store_quantizes_what_it_stores_unquantized(has_norm: bool) -> None:
    """The fused kernel into an fp8 cache stores kv_quant's quantization of what it stores into a
    LOW cache, and returns the same q."""
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
    low = [torch.zeros(shape, dtype=LOW, device=DEVICE) for _ in range(2)]
    fp8 = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    scales = [worker_scales(shape, 0.0) for _ in range(2)]
    q_low = rope_and_store(q, k, v, positions, cos, sin, *low, slots, q_norm_weight=norm, k_norm_weight=norm)
    q_fp8 = rope_and_store(q, k, v, positions, cos, sin, *fp8, slots, q_norm_weight=norm, k_norm_weight=norm,
                           k_scale=scales[0], v_scale=scales[1])
    assert torch.equal(q_fp8, q_low), "q does not depend on the cache dtype"
    for index, name in enumerate("kv"):
        stored = fp8[index].view(-1, kv_heads, head_dim)[slots]
        assert_quantized(stored, scales[index].reshape(-1, kv_heads)[slots],
                         low[index].view(-1, kv_heads, head_dim)[slots], f"rope+store {name}")


@pytest.mark.parametrize("splits", ["one", "auto"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [LOW, torch.float32])  # float16 scales V tiles, others the probabilities
def test_decode_over_fp8_matches_dequantized_reference(splits: str, group: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 16, 17, 63, 65, *random_lengths(3, 2, small(3000, 200), seed=group), 0]
    base = make_batch(seq_lens, [1] * len(seq_lens), block_size=16, num_heads=2 * group, num_kv_heads=2,
                      head_dim=64, dtype=dtype, seed=group)
    quantized, (k_scale, v_scale), dequantized = fp8_batch(base)
    num_splits = 1 if splits == "one" else choose_num_splits(len(seq_lens), 2, max(seq_lens), DEVICE)
    scale = 64 ** -0.5
    out = torch.full_like(base.q, float("nan"))
    paged_decode(quantized.q, quantized.k_cache, quantized.v_cache, quantized.block_tables,
                 torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale, num_splits, out=out,
                 k_scale=k_scale, v_scale=v_scale)
    assert_matches(out, reference(dequantized, scale), base, f"fp8 decode splits={num_splits} group={group}")


@pytest.mark.parametrize("dtype", [LOW, torch.float32])
def test_prefill_over_fp8_matches_dequantized_reference(dtype: torch.dtype) -> None:
    cases = prefill_cases(16)
    base = make_batch([p + n for p, n in cases], [n for _, n in cases], block_size=16, num_heads=4, num_kv_heads=2,
                      head_dim=64, dtype=dtype, seed=7)
    quantized, (k_scale, v_scale), dequantized = fp8_batch(base)
    metadata = base.metadata()
    scale = 64 ** -0.5
    out = torch.full_like(base.q, float("nan"))
    paged_prefill(quantized.q, quantized.k_cache, quantized.v_cache, quantized.block_tables, metadata.seq_lens,
                  metadata.query_start_loc, metadata.max_query_len, scale, out=out, k_scale=k_scale,
                  v_scale=v_scale)
    assert_matches(out, reference(dequantized, scale), base, f"fp8 prefill {dtype}")


def test_fp8_cache_without_scales_is_refused() -> None:
    batch = make_batch([5], [1], block_size=16, num_heads=2, num_kv_heads=2, head_dim=64, dtype=LOW, seed=0)
    quantized, _, _ = fp8_batch(batch)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode(quantized.q, quantized.k_cache, quantized.v_cache, quantized.block_tables,
                     torch.tensor([5], dtype=torch.int32, device=DEVICE), 0.1, 1)
