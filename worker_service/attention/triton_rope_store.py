"""Triton kernel that prepares one attention layer's new tokens in a single launch: the per-head
q/k RMSNorm (Qwen3), rotary on q and k, and the store of k and v into the paged KV cache.

Eagerly this is five small kernels per layer (two norms, two rotaries, store_kv), which in a decode
step cost launches and latency rather than bandwidth. A token's q heads are read straight from the
qkv projection output (a strided view) and written rotated to a new contiguous tensor, its rotated k
and plain v at its cache slot (a negative slot marks a padding token: q is still written, K/V are
not). One program does all of a token's work, or, for an fp8 cache and for a few tokens, a few
programs side by side (groups of q heads, and k and v): shorter chains of dependent loads and stores,
which is what the quantization and a lone token wait on.

The float math follows the eager composition (`norm.rms_norm`, then `rotary.apply_rotary`, then
store_kv) operation by operation and rounding by rounding, and the launch disables FMA contraction
so that none of it is fused away. The one thing it cannot follow is the order in which the norm's
float32 sum of squares is reduced (PyTorch's depends on the device, the CPU's vector ISA and, on
CUDA, the number of rows). Where that sum is not exact in float32 the variance may differ in its
last bits; in bf16/fp16 that flips the rounding of a normalised value by one unit in the rare case
that it sits next to a rounding boundary (the test bounds the effect on q and k by 4 eps times the
head's largest magnitude). Without the norms, or when the sum is exact, the result is bit-identical.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_service.attention.kv_quant import is_fp8
from worker_service.attention.triton_common import (
    check_kernel_operands,
    fp8_head_scales,
    fp8_quantize,
    scale_operands,
)
from worker_service.layers.triton_pdl import pdl_options, wait_for_previous_kernel

# Heads one program handles per step of its head loop: bounds the registers of the [heads, head_dim]
# tiles (16 heads of 128 at a time) for models with many heads.
_MAX_TILE_ELEMENTS = 2048
# Where a token's work is split (an fp8 cache, or at most SPLIT_MAX_TOKENS tokens), its q heads go to
# programs of Q_HEADS_PER_PROGRAM heads each and its k and v to one more; elsewhere one program does it
# all. On an H100 (bench/results/2026-12-08-h100-rope-store-split.md) the split made the reference
# workload 1.5 % faster with the fp8 cache and one stream's decode layer 1.3 % faster, but a bf16 cache
# at full batch 0.3-0.4 % slower.
Q_HEADS_PER_PROGRAM = 8
SPLIT_MAX_TOKENS = 16


@triton.jit
def _norm_and_rotate(x_ptr, stride_head, heads, head_mask, cos, sin, norm_ptr, eps,
                     HALF_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Loads heads [len(heads), 2 * HALF_DIM] of one token at x_ptr, applies the RMSNorm with weight
    norm_ptr when HAS_NORM, then rotary with cos/sin [1, HALF_DIM]. Returns the two rotated halves
    in x's dtype."""
    dims = tl.arange(0, HALF_DIM)
    ptrs = x_ptr + heads[:, None] * stride_head + dims[None, :]
    mask = head_mask[:, None]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF_DIM, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:
        # norm.rms_norm: float32 variance (a power-of-two divisor, so the multiply is exact), the
        # normalised value rounded to the input dtype, then times the weight, rounded again. The
        # product of two 16-bit floats is exact in float32, so one rounding matches torch's.
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        variance = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) * (1.0 / (2 * HALF_DIM))
        inv_rms = tl.math.rsqrt(variance + eps)[:, None]
        w1 = tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + HALF_DIM + dims).to(tl.float32)[None, :]
        x1 = (w1 * (a * inv_rms).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2 * (b * inv_rms).to(dtype).to(tl.float32)).to(dtype)
    # rotary._rotate: "rotate half" in float32, each product rounded before the add.
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return (a * cos - b * sin).to(dtype), (b * cos + a * sin).to(dtype)


@triton.jit
def _rotate_q_heads(q_ptr, q_out_ptr, q_norm_ptr, eps, stride_q_head, stride_out_head, first_head, cos, sin,
                    NUM_HEADS: tl.constexpr, Q_HEADS_PER_PROGRAM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                    HALF_DIM: tl.constexpr, HAS_Q_NORM: tl.constexpr):
    """Norms and rotates one token's q heads [first_head, first_head + Q_HEADS_PER_PROGRAM) into q_out."""
    dims = tl.arange(0, HALF_DIM)
    for head_start in tl.static_range(0, Q_HEADS_PER_PROGRAM, BLOCK_HEADS):
        heads = first_head + head_start + tl.arange(0, BLOCK_HEADS)
        mask = heads < tl.minimum(NUM_HEADS, first_head + Q_HEADS_PER_PROGRAM)
        q1, q2 = _norm_and_rotate(q_ptr, stride_q_head, heads, mask, cos, sin, q_norm_ptr, eps, HALF_DIM, HAS_Q_NORM)
        dst = q_out_ptr + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(dst, q1, mask=mask[:, None])
        tl.store(dst + HALF_DIM, q2, mask=mask[:, None])


@triton.jit
def _store_kv(k_ptr, v_ptr, k_norm_ptr, eps, stride_k_head, stride_v_head, cos, sin,
              k_dst_ptr, v_dst_ptr, k_scale_ptr, v_scale_ptr, stride_kc_head, stride_vc_head, stride_s_head,
              NUM_KV_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
              HAS_K_NORM: tl.constexpr, IS_FP8: tl.constexpr):
    """Norms and rotates one token's k heads and writes them and its v heads at k_dst_ptr / v_dst_ptr
    (its cache slot; an fp8 cache's scales at k_scale_ptr / v_scale_ptr)."""
    HALF_DIM: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HALF_DIM)
    all_dims = tl.arange(0, HEAD_DIM)
    k_type = k_dst_ptr.dtype.element_ty
    v_type = v_dst_ptr.dtype.element_ty
    for kv_start in tl.static_range(0, NUM_KV_HEADS, BLOCK_KV_HEADS):
        kv_heads = kv_start + tl.arange(0, BLOCK_KV_HEADS)
        kv_mask = kv_heads < NUM_KV_HEADS
        k1, k2 = _norm_and_rotate(k_ptr, stride_k_head, kv_heads, kv_mask, cos, sin, k_norm_ptr, eps, HALF_DIM,
                                  HAS_K_NORM)
        v = tl.load(v_ptr + kv_heads[:, None] * stride_v_head + all_dims[None, :], mask=kv_mask[:, None])
        k_dst = k_dst_ptr + kv_heads[:, None] * stride_kc_head + dims[None, :]
        v_dst = v_dst_ptr + kv_heads[:, None] * stride_vc_head + all_dims[None, :]
        if IS_FP8:
            # One scale per head vector, over both rotated halves of k.
            k_amax = tl.maximum(tl.max(tl.abs(k1.to(tl.float32)), axis=1), tl.max(tl.abs(k2.to(tl.float32)), axis=1))
            k_scales = fp8_head_scales(k_amax)
            v_scales = fp8_head_scales(tl.max(tl.abs(v.to(tl.float32)), axis=1))
            tl.store(k_scale_ptr + kv_heads * stride_s_head, k_scales, mask=kv_mask)
            tl.store(v_scale_ptr + kv_heads * stride_s_head, v_scales, mask=kv_mask)
            tl.store(k_dst, fp8_quantize(k1, k_scales, k_type), mask=kv_mask[:, None])
            tl.store(k_dst + HALF_DIM, fp8_quantize(k2, k_scales, k_type), mask=kv_mask[:, None])
            tl.store(v_dst, fp8_quantize(v, v_scales, v_type), mask=kv_mask[:, None])
        else:
            tl.store(k_dst, k1.to(k_type), mask=kv_mask[:, None])
            tl.store(k_dst + HALF_DIM, k2.to(k_type), mask=kv_mask[:, None])
            tl.store(v_dst, v.to(v_type), mask=kv_mask[:, None])


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cos, stride_sin, stride_out_tok, stride_out_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_s_block, stride_s_tok, stride_s_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_PER_PROGRAM: tl.constexpr,
    KV_APART: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, IS_FP8: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (tokens, parts): the first parts rotate Q_HEADS_PER_PROGRAM of the token's q heads each; k
    and v are stored by one part more (KV_APART) or by the last q part."""
    if PDL:
        wait_for_previous_kernel()
    HALF_DIM: tl.constexpr = HEAD_DIM // 2
    NUM_Q_PROGRAMS: tl.constexpr = (NUM_HEADS + Q_HEADS_PER_PROGRAM - 1) // Q_HEADS_PER_PROGRAM
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    dims = tl.arange(0, HALF_DIM)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * stride_cos + dims)[None, :]
    sin = tl.load(sin_ptr + position * stride_sin + dims)[None, :]
    if part < NUM_Q_PROGRAMS:
        _rotate_q_heads(q_ptr + token * stride_q_tok, q_out_ptr + token * stride_out_tok, q_norm_ptr, eps,
                        stride_q_head, stride_out_head, part * Q_HEADS_PER_PROGRAM, cos, sin,
                        NUM_HEADS, Q_HEADS_PER_PROGRAM, BLOCK_HEADS, HALF_DIM, HAS_Q_NORM)
    if part == NUM_Q_PROGRAMS - 1 + KV_APART:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            _store_kv(k_ptr + token * stride_k_tok, v_ptr + token * stride_v_tok, k_norm_ptr, eps,
                      stride_k_head, stride_v_head, cos, sin,
                      k_cache_ptr + block * stride_kc_block + offset * stride_kc_tok,
                      v_cache_ptr + block * stride_vc_block + offset * stride_vc_tok,
                      k_scale_ptr + block * stride_s_block + offset * stride_s_tok,
                      v_scale_ptr + block * stride_s_block + offset * stride_s_tok,
                      stride_kc_head, stride_vc_head, stride_s_head,
                      NUM_KV_HEADS, BLOCK_KV_HEADS, HEAD_DIM, HAS_K_NORM, IS_FP8)


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, *, q_norm_weight: torch.Tensor | None = None,
                   k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Norms (optional), rotates and stores one layer's new tokens; returns the rotated q.

    q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim]: one dtype,
    any token and head strides (e.g. views of the fused qkv output), contiguous last dimension.
    positions [num_tokens] (integer) index cos and sin [max_positions, head_dim // 2] (float32).
    q_norm_weight / k_norm_weight [head_dim] in q's dtype, or None to skip that norm; eps is shared.
    k (rotated) and v are converted to the cache dtype and written into k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens] (block_id *
    block_size + offset; negative = padding, not written); for an fp8 cache each head vector is
    divided by its scale, written to k_scale / v_scale [num_blocks, block_size, num_kv_heads]
    (float32; None otherwise; see kv_quant). Returns a new contiguous
    [num_tokens, num_heads, head_dim] tensor in q's dtype. No host sync (CUDA graph capturable);
    positions are not bounds-checked.
    """
    _check_operands(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    max_tile_heads = max(1, _MAX_TILE_ELEMENTS // head_dim)
    fp8 = is_fp8(k_cache.dtype)
    split = fp8 or num_tokens <= SPLIT_MAX_TOKENS
    q_heads_per_program = min(Q_HEADS_PER_PROGRAM, num_heads) if split else num_heads
    k_scale, v_scale, scale_strides = scale_operands(k_cache, k_scale, v_scale)
    _rope_store_kernel[(num_tokens, triton.cdiv(num_heads, q_heads_per_program) + int(split))](
        q, k, v, positions, cos, sin,
        q if q_norm_weight is None else q_norm_weight,  # unread placeholders when there is no norm
        q if k_norm_weight is None else k_norm_weight,
        eps, q_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_PER_PROGRAM=q_heads_per_program, KV_APART=split,
        BLOCK_HEADS=min(triton.next_power_of_2(q_heads_per_program), max_tile_heads),
        BLOCK_KV_HEADS=min(triton.next_power_of_2(num_kv_heads), max_tile_heads),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None, IS_FP8=fp8,
        # An FMA would skip the rounding of a product that the eager composition performs.
        enable_fp_fusion=False, num_warps=4, **pdl_options(q.device),
    )
    return q_out


def _check_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None,
                    k_norm_weight: torch.Tensor | None) -> None:
    """Shapes, dtypes and strides the kernel relies on (host metadata only: no sync)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [tokens, heads, head_dim] and k, v [tokens, kv_heads, head_dim] alike, "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on tokens or head_dim")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cache_shape = (k.shape[1], head_dim)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != cache_shape:
        raise ValueError(f"caches must be [num_blocks, block_size, {cache_shape[0]}, {head_dim}], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (num_tokens,) or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 of shape ({num_tokens},), "
                             f"got {index.dtype} {tuple(index.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [max_positions, {head_dim // 2}], "
                             f"got {table.dtype} {tuple(table.shape)}")
        if table.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {table.stride()}")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != q.dtype
                                   or weight.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}] tensor in {q.dtype}, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
    check_kernel_operands(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
