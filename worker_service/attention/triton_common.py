"""Small helpers shared by the Triton attention kernels: their launchers' checks, and the FP8 store."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from worker_service.attention.kv_quant import FP8_DTYPE, FP8_MAX, SCALE_DTYPE

LOG2E = math.log2(math.e)  # folded into the softmax scale so that the kernels can use exp2
FP8_MAX_VALUE = tl.constexpr(FP8_MAX)
H200_NUM_SMS = 132  # fallback when the device cannot be asked (CPU, Triton's interpreter)


def check_kernel_operands(**tensors: torch.Tensor) -> None:
    """The kernels index head_dim with unit stride and a power-of-two tile (which is what makes
    their loads 16-byte wide and coalesced); reject anything else early with a clear message."""
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {tensor.stride()}")
        head_dim = tensor.shape[-1]
        if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
            raise ValueError(f"{name}: head_dim must be a power of two in [16, 256], got {head_dim}")


def attention_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Query heads per KV head of an attention call, after checking the operands; q [tokens,
    num_heads, head_dim], caches [num_blocks, block_size, num_kv_heads, head_dim]."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_kernel_operands(q=q, k_cache=k_cache, v_cache=v_cache)
    return num_heads // num_kv_heads


def compute_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype whose dot precision the attention kernels ask for: the cache's, or q's for an fp8
    cache (prefill widens fp8 to q's dtype, decode to float16; q is never narrowed to fp8, which
    would add its own rounding)."""
    return q.dtype if k_cache.dtype == FP8_DTYPE else k_cache.dtype


@triton.jit
def fp8_head_scales(amax):
    """Scales of head vectors whose largest magnitudes are amax: kv_quant.head_scales (the same
    product with the reciprocal of 448, rounded alike everywhere)."""
    return tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)


@triton.jit
def widen_fp8_in_registers(x):
    """e4m3 values x as float16, converted where x was loaded (CUDA sm_89+ only: inline PTX).

    tl.dot's operand conversions are moved by Triton to after the shared-memory read of the operand;
    for V (reduced over tokens but stored token-major) that read is one byte at a time when V is fp8
    (128 ld.shared.b8 a thread a 128-token tile in the sm_90 PTX). Not pure, so Triton keeps it here:
    V is widened in registers and goes through shared memory as float16 (ldmatrix.trans): the fp8
    decode 9-13 % faster (bench/results/2026-12-01-h200-fp8-decode-variants.txt)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def fp8_quantize(x, scales, cache_dtype: tl.constexpr):
    """Head vectors x [heads, dims] divided by their scales [heads] and saturated: kv_quant.quantize."""
    scaled = tl.math.div_rn(x.to(tl.float32), scales[:, None])
    return tl.clamp(scaled, -FP8_MAX_VALUE, FP8_MAX_VALUE).to(cache_dtype)


def scale_operands(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """The scale tensors and their (block, token, head) strides to launch a kernel with: checked
    for an fp8 cache (float32 [num_blocks, block_size, num_kv_heads], one layout for K and V), the
    cache itself as an unread placeholder otherwise."""
    if k_cache.dtype != FP8_DTYPE:
        return k_cache, k_cache, (0, 0, 0)
    expected = tuple(k_cache.shape[:3])
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None or tuple(scales.shape) != expected or scales.dtype != SCALE_DTYPE:
            raise ValueError(f"an fp8 cache needs {name} float32 {expected}, got "
                             f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale and v_scale must share strides, got {k_scale.stride()} and {v_scale.stride()}")
    return k_scale, v_scale, k_scale.stride()


def dot_precision(dtype: torch.dtype) -> str:
    """Triton's tl.dot rounds float32 operands to tf32 by default (~3e-4 relative error); ask for
    full float32 when the cache is float32, since that is only used for tests and references."""
    return "ieee" if dtype == torch.float32 else "tf32"
