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

NEG_BIG = tl.constexpr(-1.0e30)  # a slot's running max before its first token: finite, so exp2(m - m_new) is never NaN


@triton.jit
def _load_tile(k_head, v_head, k_scale_head, v_scale_head, table, tile_start, end, page, stride_k_block,
               stride_k_tok, stride_v_block, stride_v_tok, stride_s_block, stride_s_tok, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The fp8 K and V of the tile at tile_start as 32-bit words [BLOCK_N, 1, HEAD_DIM // 4] (four values
    each; the 3-d shape, tokens before rows, makes Triton give lanes and warps to tokens and head_dim and
    each thread its query rows) and their scales [BLOCK_N, 1]; nothing loaded at and past end. page: the
    tile's page when it lies in one (BLOCK_N <= BLOCK_SIZE), else unused (pages loaded per token)."""
    tokens = tile_start + tl.arange(0, BLOCK_N)
    mask = tokens < end
    if BLOCK_N > BLOCK_SIZE:
        page = tl.load(table + tokens // BLOCK_SIZE, mask=mask, other=0)
    within = tokens % BLOCK_SIZE
    page = page.to(tl.int64)
    words = tl.arange(0, HEAD_DIM // 4)[None, None, :]
    mask3 = mask[:, None, None]
    k_rows = ((page * stride_k_block + within * stride_k_tok) // 4)[:, None, None]
    v_rows = ((page * stride_v_block + within * stride_v_tok) // 4)[:, None, None]
    k = tl.load(k_head.to(tl.pointer_type(tl.int32)) + k_rows + words, mask=mask3, other=0)
    v = tl.load(v_head.to(tl.pointer_type(tl.int32)) + v_rows + words, mask=mask3, other=0)
    scale_rows = (page * stride_s_block + within * stride_s_tok)[:, None]
    k_scales = tl.load(k_scale_head + scale_rows, mask=mask[:, None], other=0.0)
    v_scales = tl.load(v_scale_head + scale_rows, mask=mask[:, None], other=0.0)
    return k, v, k_scales, v_scales


@triton.jit
def _widen_words(words, INLINE: tl.constexpr):
    """Each 32-bit word of four e4m3 values as four float32 tensors (bytes 0..3): two values a conversion
    instruction to float16, then each to float32 (Triton's own conversion of fp8 tensors unpacks and
    repacks every byte first: three times the instructions). INLINE False under the interpreter, which
    runs no PTX: the same values by arithmetic."""
    if INLINE:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, a, b, c, d; .reg .b32 h01, h23; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 h01, lo; cvt.rn.f16x2.e4m3x2 h23, hi; mov.b32 {a, b}, h01; mov.b32 {c, d}, h23; "
            "cvt.f32.f16 $0, a; cvt.f32.f16 $1, b; cvt.f32.f16 $2, c; cvt.f32.f16 $3, d; }",
            "=f,=f,=f,=f,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return _e4m3_value(words, 0), _e4m3_value(words, 8), _e4m3_value(words, 16), _e4m3_value(words, 24)


@triton.jit
def _e4m3_value(words, shift: tl.constexpr):
    """The e4m3 value in bits shift..shift+7 of words, as float32 (finite values only: the cache holds no NaN)."""
    bits = (words >> shift) & 0xFF
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 7).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125,  # subnormal: mantissa * 2**-9
                         (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32)))
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _quarters(x, HEAD_DIM: tl.constexpr):
    """x [BLOCK_H, HEAD_DIM] as four [BLOCK_H, HEAD_DIM // 4] tensors: elements 0, 1, 2, 3 modulo 4."""
    BLOCK_H: tl.constexpr = x.shape[0]
    even, odd = tl.split(tl.reshape(x, [BLOCK_H, HEAD_DIM // 2, 2]))
    x0, x2 = tl.split(tl.reshape(even, [BLOCK_H, HEAD_DIM // 4, 2]))
    x1, x3 = tl.split(tl.reshape(odd, [BLOCK_H, HEAD_DIM // 4, 2]))
    return x0, x1, x2, x3


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
    q0, q1, q2, q3 = _quarters(q, HEAD_DIM)
    q0, q1, q2, q3 = q0[None, :, :], q1[None, :, :], q2[None, :, :], q3[None, :, :]  # [1, BLOCK_H, HEAD_DIM // 4]
    m = tl.full([BLOCK_N, BLOCK_H], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)  # noqa: E741
    acc0 = tl.zeros([BLOCK_N, BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)  # output element 4j + 0, and so on
    acc1 = tl.zeros([BLOCK_N, BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
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
        k0, k1_, k2_, k3 = _widen_words(k, INLINE_WIDEN)
        products = q0 * k0 + q1 * k1_ + q2 * k2_ + q3 * k3
        scores = tl.sum(products, 2) * k_scales  # [BLOCK_N, BLOCK_H]
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, scores)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new)
        l = l * alpha + p  # noqa: E741
        alpha = alpha[:, :, None]
        weight = (p * v_scales)[:, :, None]
        v0, v1_, v2_, v3 = _widen_words(v, INLINE_WIDEN)
        acc0 = acc0 * alpha + weight * v0
        acc1 = acc1 * alpha + weight * v1_
        acc2 = acc2 * alpha + weight * v2_
        acc3 = acc3 * alpha + weight * v3
        m = m_new
        k, v, k_scales, v_scales = k1, v1, k_scales1, v_scales1
        k1, v1, k_scales1, v_scales1 = k2, v2, k_scales2, v_scales2
    # The slots merged: each slot's sums rescaled to the largest max; the quarters interleaved back.
    m_row = tl.max(m, 0)
    weights = tl.exp2(m - m_row[None, :])
    l_row = tl.sum(l * weights, 0)
    weights = weights[:, :, None]
    acc_row = tl.interleave(tl.interleave(tl.sum(acc0 * weights, 0), tl.sum(acc2 * weights, 0)),
                            tl.interleave(tl.sum(acc1 * weights, 0), tl.sum(acc3 * weights, 0)))
    return acc_row, m_row, l_row
