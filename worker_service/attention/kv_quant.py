"""The FP8 KV cache's number format: float8_e4m3fn with one float32 scale per token and KV head.

Each cached head vector x (head_dim values of one token's K or V) is stored as
fp8(clamp(x / s, -448, 448)) with s = max|x| / 448 kept next to the cache (1.0 for an all-zero
vector), and read back as fp8 * s. Why per token and head, not one scale per layer:

- e4m3 has 3 mantissa bits, so every value is off by up to 2**-4 of itself whatever the scale; what
  a scale decides is where the 15 binades of normal numbers sit. K of a model without q/k norms
  has a few outlier channels (SmolLM2-135M: |K| up to ~20, most values far below 1); with the fixed
  scale 1.0 (vLLM's default without calibration) small values of K and V fall into e4m3's
  subnormals (below 2**-6), and the outlier channels that dominate q.k are rounded like the rest.
  With s = max|x| / 448 the largest value of each vector is stored exactly and the vector's range
  maps onto the normal numbers. Measured teacher-forced on the default model (first 300 tokens of
  the quality bench's text, bench/results/2026-11-30-cpu-fp8-kv-quality.txt): top-1 agreement with
  the unquantized cache 93.3 % with scale 1.0, 95.3 % with per-layer scales calibrated on that
  same text, 97.0 % per token and head; over 2,046 positions per token and head gives 96.4 %,
  perplexity +0.9 % (short of the 98 % asked for: e4m3's 3 mantissa bits on K are what is left).
- It needs no calibration data and adapts to any model and any prompt.
- The cost: 4 bytes per head vector next to head_dim bytes of fp8 (3 % more bytes at head_dim
  128), one extra [tokens] load per tile in the attention kernels, and a multiply of each score
  column (K) and of each probability column (V) by its scale.

bench/fp8_kv_quality.py measures it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
KV_CACHE_DTYPE_NAMES = ("auto", "fp8")
SCALE_DTYPE = torch.float32


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache for WorkerConfig.kv_cache_dtype name."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {name!r}; known: {KV_CACHE_DTYPE_NAMES}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def allocate_scales(allocate: Callable[..., torch.Tensor], leading_shape: tuple[int, ...], block_size: int,
                    num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """Scales [*leading_shape, block_size, num_kv_heads] (float32; leading_shape ends with num_blocks)
    stored head by head within a block: one head's scales of consecutive tokens are adjacent floats, so
    a kernel's tile of one head's scales is one coalesced read, not one float in every num_kv_heads
    (5-8 % of the fp8 decode kernel's time, bench/results/2026-12-01-h200-fp8-decode-variants.txt).
    The kernels and the torch backend take any strides; this is the one place that picks them."""
    storage = allocate((*leading_shape, num_kv_heads, block_size), dtype=SCALE_DTYPE, device=device)
    return storage.transpose(-1, -2)


def head_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 scales [...] of head vectors x [..., head_dim]: max|x| / 448, or 1.0 where x is all 0."""
    amax = x.float().abs().amax(dim=-1)
    # A product, not a quotient: torch on CUDA divides by a scalar as a product with its reciprocal,
    # so only the product is computed alike by torch (CPU and CUDA) and the Triton store kernels.
    return torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))


def quantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] divided by scales [...] and saturated to e4m3."""
    return (x.float() / scales[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 x [..., head_dim] times scales [...], in float32."""
    return x.float() * scales[..., None]
