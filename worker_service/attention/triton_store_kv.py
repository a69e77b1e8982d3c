"""Triton kernel that writes new K/V rows into the paged KV cache.

One program per new token copies all of its KV heads (num_kv_heads x head_dim elements, 2 KiB for
Qwen3-0.6B in bf16) for K and for V. A negative slot marks a padding token (a CUDA graph batch
padded to its captured size): the program returns without writing.
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


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_s_block, stride_s_tok, stride_s_head,
    NUM_KV_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    # int64: one layer's cache can hold more than 2**31 elements.
    block = (slot // BLOCK_SIZE).to(tl.int64)
    offset = (slot % BLOCK_SIZE).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, HEAD_DIM)
    mask = heads[:, None] < NUM_KV_HEADS
    token64 = token.to(tl.int64)

    k = tl.load(k_ptr + token64 * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token64 * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_block + offset * stride_kc_tok + heads[:, None] * stride_kc_head
    v_dst = v_cache_ptr + block * stride_vc_block + offset * stride_vc_tok + heads[:, None] * stride_vc_head
    if IS_FP8:
        k_scales = fp8_head_scales(tl.max(tl.abs(k.to(tl.float32)), axis=1))
        v_scales = fp8_head_scales(tl.max(tl.abs(v.to(tl.float32)), axis=1))
        scale_offsets = block * stride_s_block + offset * stride_s_tok + heads * stride_s_head
        tl.store(k_scale_ptr + scale_offsets, k_scales, mask=heads < NUM_KV_HEADS)
        tl.store(v_scale_ptr + scale_offsets, v_scales, mask=heads < NUM_KV_HEADS)
        tl.store(k_dst + dims[None, :], fp8_quantize(k, k_scales, k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + dims[None, :], fp8_quantize(v, v_scales, v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_dst + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Writes k, v [num_tokens, num_kv_heads, head_dim] into k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] at slot_mapping [num_tokens] (int64,
    block_id * block_size + offset; negative = skip). Converts to the cache dtype; for an fp8 cache
    also writes each head vector's scale into k_scale / v_scale [num_blocks, block_size,
    num_kv_heads] (float32; None otherwise). No host sync."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"{num_tokens} new tokens but {slot_mapping.shape[0]} slots")
    if num_tokens == 0:
        return
    check_kernel_operands(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    block_size = k_cache.shape[1]
    k_scale, v_scale, scale_strides = scale_operands(k_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        NUM_KV_HEADS=num_kv_heads, BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, IS_FP8=is_fp8(k_cache.dtype), num_warps=4,
    )

