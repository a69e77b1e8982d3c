"""The FP8 KV cache's number format: float8_e4m3fn with one scale per layer for K and one for V.

A cached value x is stored as fp8(clamp(x / scale, -448, 448)) and read back as fp8 * scale. With a
scale per tensor (not per token or per head) the kernels fold it into constants they already use:
the K scale into the softmax scale, the V scale into the final normalisation, so reading the cache
costs nothing beyond the conversion of each fp8 element, and nothing is stored next to the cache.

The scale is 1.0 (vLLM's default without calibration). e4m3 keeps 3 mantissa bits over
[2**-6, 448] (a relative rounding error of at most 2**-4) and subnormals down to 2**-9; K and V of
the models served here lie well inside that range (bench/fp8_kv_quality.py prints the largest
|K| and |V| per model; SmolLM2-135M's K peaks near 20, V near 3), so a scale would only move values
between the saturation and subnormal ends, which neither carries much weight in attention. The
clamp turns an outlier beyond 448 into 448 rather than NaN (the conversion does not saturate on
every device). The quality bench measures the cost: see bench/results/fp8_kv_quality.txt.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_KV_SCALE = 1.0
KV_CACHE_DTYPE_NAMES = ("auto", "fp8")


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache for WorkerConfig.kv_cache_dtype name."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return FP8_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {name!r}; known: {KV_CACHE_DTYPE_NAMES}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x converted for a cache of dtype: divided by scale and saturated when dtype is fp8."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache contents x as stored values: float32 times scale from an fp8 cache, else x itself."""
    if not is_fp8(x.dtype):
        return x
    return x.float() * scale if scale != 1.0 else x.float()
