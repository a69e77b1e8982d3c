"""Paged decode attention over an fp8 (e4m3) cache on the CUDA cores, without tensor cores.

Why not tl.dot: a decode program holds one KV head's GROUP query heads (2 for Qwen3-0.6B), and a
tensor-core tile has at least 16 rows, so 14 of 16 rows of every score and probability tile were
padding: the softmax's exp2, max and scaling ran 8 times over, and its reductions across warps took
shared-memory round trips and barriers every tile. With half the bytes of a bf16 tile to hide that
work behind, the fp8 kernel read its cache at ~60 % of the copy bandwidth.

Here the GROUP rows are computed as they are, with products and sums on the CUDA cores, and the
online softmax runs per slot: a tile of BLOCK_N = SUB x SLOTS tokens is loaded as [SUB, SLOTS,
head_dim] (each token's head_dim bytes contiguous: 16-byte coalesced loads), and each of the SLOTS
slots keeps its own running max, sum and output accumulator over the tokens that fall in it (token
t of the split goes to slot t % SLOTS). Nothing is reduced across threads inside the loop except
each score's sum over head_dim, which stays within a warp; the slots are merged once, after the
loop. K's scales multiply the scores, V's the probabilities, q carries the softmax scale.

The split-K semaphore, the grid order (longest sequences first) and the outputs are those of
triton_decode, whose helpers this kernel shares.
"""
from __future__ import annotations

import triton
import triton.language as tl

from worker_service.attention.triton_common import widen_fp8_in_registers

NEG_BIG = tl.constexpr(-1.0e30)  # a slot's running max before its first token: finite, so exp2(m - m_new) is never NaN


@triton.jit
def _load_tile(k_head, v_head, k_scale_head, v_scale_head, table, tile_start, end, page, stride_k_block,
               stride_k_tok, stride_v_block, stride_v_tok, stride_s_block, stride_s_tok, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The fp8 K and V of the tile at tile_start as [BLOCK_N, 1, HEAD_DIM] (the 3-d load gives the
    products their layout, head_dim within a warp) and their scales [BLOCK_N, 1]; nothing loaded at and
    past end. page: the tile's
    page when it lies in one (BLOCK_N <= BLOCK_SIZE), else unused (pages loaded per token)."""
    tokens = tile_start + tl.arange(0, BLOCK_N)
    mask = tokens < end
    if BLOCK_N > BLOCK_SIZE:
        page = tl.load(table + tokens // BLOCK_SIZE, mask=mask, other=0)
    within = tokens % BLOCK_SIZE
    page = page.to(tl.int64)
    # [BLOCK_N, 1, HEAD_DIM] (the products broadcast it over the query rows): tokens before rows and
    # head_dim, so that Triton gives lanes and warps to tokens and head_dim, the rows to each thread.
    dims = tl.arange(0, HEAD_DIM)[None, None, :]
    mask3 = mask[:, None, None]
    k_rows = (page * stride_k_block + within * stride_k_tok)[:, None, None]
    v_rows = (page * stride_v_block + within * stride_v_tok)[:, None, None]
    k = tl.load(k_head + k_rows + dims, mask=mask3, other=0.0)
    v = tl.load(v_head + v_rows + dims, mask=mask3, other=0.0)
    scale_rows = (page * stride_s_block + within * stride_s_tok)[:, None]
    k_scales = tl.load(k_scale_head + scale_rows, mask=mask[:, None], other=0.0)
    v_scales = tl.load(v_scale_head + scale_rows, mask=mask[:, None], other=0.0)
    return k, v, k_scales, v_scales


@triton.jit
def _widen(x, INLINE: tl.constexpr):
    """e4m3 x as float32: two values a conversion instruction to float16, then each to float32 (Triton's
    own fp8 -> float32 path unpacks bytes first: three times the instructions); INLINE False under the
    interpreter, which runs no PTX."""
    if INLINE:
        return widen_fp8_in_registers(x).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _page_of(table, tile_start, end, BLOCK_SIZE: tl.constexpr):
    return tl.load(table + tile_start // BLOCK_SIZE, mask=tile_start < end, other=0)


@triton.jit
def fp8_decode_split(q, k_head, v_head, k_scale_head, v_scale_head, table, start, end,
                     stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, stride_s_block, stride_s_tok,
                     BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, INLINE_WIDEN: tl.constexpr):
    """Unnormalized output [BLOCK_H, HEAD_DIM], row max and row sum (log2 domain) of the query rows q
    (float32 [BLOCK_H, HEAD_DIM], the softmax scale in log2 units folded in) over tokens start..end-1 of
    one KV head of an fp8 cache; an empty range gives zeros and a max of NEG_BIG.

    Tiles are loaded two ahead of the one computed (Triton's pipeliner stages only loads that feed a
    tl.dot), and pages three ahead, so that a K/V load never waits for its page id."""
    q3 = q[None, :, :]  # [1, BLOCK_H, HEAD_DIM]
    m = tl.full([BLOCK_N, BLOCK_H], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_N, BLOCK_H, HEAD_DIM], dtype=tl.float32)
    strides = (stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, stride_s_block, stride_s_tok)
    k, v, k_scales, v_scales = _load_tile(k_head, v_head, k_scale_head, v_scale_head, table, start, end,
                                          _page_of(table, start, end, BLOCK_SIZE), *strides, BLOCK_N, HEAD_DIM,
                                          BLOCK_SIZE)
    k1, v1, k_scales1, v_scales1 = _load_tile(k_head, v_head, k_scale_head, v_scale_head, table, start + BLOCK_N,
                                              end, _page_of(table, start + BLOCK_N, end, BLOCK_SIZE), *strides,
                                              BLOCK_N, HEAD_DIM, BLOCK_SIZE)
    page2 = _page_of(table, start + 2 * BLOCK_N, end, BLOCK_SIZE)
    for tile_start in range(start, end, BLOCK_N):
        k2, v2, k_scales2, v_scales2 = _load_tile(k_head, v_head, k_scale_head, v_scale_head, table,
                                                  tile_start + 2 * BLOCK_N, end, page2, *strides,
                                                  BLOCK_N, HEAD_DIM, BLOCK_SIZE)
        page2 = _page_of(table, tile_start + 3 * BLOCK_N, end, BLOCK_SIZE)
        valid = (tile_start + tl.arange(0, BLOCK_N) < end)[:, None]
        scores = tl.sum(q3 * _widen(k, INLINE_WIDEN), 2) * k_scales  # [BLOCK_N, BLOCK_H]
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, scores)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new)
        l = l * alpha + p  # noqa: E741
        acc = acc * alpha[:, :, None] + (p * v_scales)[:, :, None] * _widen(v, INLINE_WIDEN)
        m = m_new
        k, v, k_scales, v_scales = k1, v1, k_scales1, v_scales1
        k1, v1, k_scales1, v_scales1 = k2, v2, k_scales2, v_scales2
    # The slots merged: each slot's sums rescaled to the largest max.
    m_row = tl.max(m, 0)
    weights = tl.exp2(m - m_row[None, :])
    l_row = tl.sum(l * weights, 0)
    acc_row = tl.sum(acc * weights[:, :, None], 0)
    return acc_row, m_row, l_row
