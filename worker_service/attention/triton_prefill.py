"""Prefill / mixed-batch causal attention over the paged KV cache, flash-attention style, in Triton.

Each sequence computes query_len new tokens that are the last positions of its seq_len-long
context, read entirely from the paged cache (so a cached prefix, a chunked prefill and a decode
row are all the same case). Grid (query tiles, num_kv_heads, num_seqs). The rows of a program's
tile are (token, query head) pairs of the GROUP query heads that share one KV head, token-major,
so each K/V tile is loaded once per KV head and a decode row (one token) still fills GROUP rows.

Per tile the context splits in two ranges: keys before the tile's first query position, visible
to every row (no mask), then the few tiles along the diagonal, masked causally. Online softmax in
float32 in the log2 domain (log2(e) folded into the scale, exp2). An fp8 cache (kv_quant) is
widened to q's dtype on load: each score column is multiplied by its token's K scale, each V row by
its V scale before the second dot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_service.attention.kv_quant import is_fp8
from worker_service.attention.triton_common import LOG2E, attention_group, compute_dtype, dot_precision, scale_operands
from worker_service.attention.triton_paging import load_page_ids, token_offsets

PREFILL_BLOCK_N = 64  # context tokens per K/V tile
PREFILL_MAX_BLOCK_M = 128  # (token, head) rows per query tile
PREFILL_NUM_STAGES = 3  # next tile's K/V in flight while this one computes (>= 3 needed: see triton_paging)


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_positions, k_head, v_head, k_scale_head, v_scale_head, table, lo, hi,
                  scale_log2, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, stride_s_block,
                  stride_s_tok, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  IS_DIAGONAL: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with the keys at positions lo..hi-1 (lo a multiple
    of BLOCK_N). Off the diagonal every key is visible to every row and below seq_len: no masks."""
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    last_position = tl.max(q_positions, 0)
    page_ids = load_page_ids(table, lo, hi, BLOCK_SIZE, BLOCK_N)
    for tile_start in range(lo, hi, BLOCK_N):
        positions = tile_start + cols
        k_rows = k_head + token_offsets(page_ids, tile_start, stride_k_block, stride_k_tok, BLOCK_SIZE, BLOCK_N)
        v_rows = v_head + token_offsets(page_ids, tile_start, stride_v_block, stride_v_tok, BLOCK_SIZE, BLOCK_N)
        if IS_FP8:
            scale_rows = token_offsets(page_ids, tile_start, stride_s_block, stride_s_tok, BLOCK_SIZE, BLOCK_N)
        page_ids = load_page_ids(table, tile_start + BLOCK_N, hi, BLOCK_SIZE, BLOCK_N)  # next tile's, early
        key_mask = positions <= last_position  # all true off the diagonal
        if IS_DIAGONAL:
            k = tl.load(k_rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
            v = tl.load(v_rows[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0)
        else:
            k = tl.load(k_rows[:, None] + dims[None, :])
            v = tl.load(v_rows[:, None] + dims[None, :])
        # q is in the dots' dtype already; an fp8 cache's tiles are widened to it (else a no-op).
        k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if IS_FP8:
            if IS_DIAGONAL:
                k_scales = tl.load(k_scale_head + scale_rows, mask=key_mask, other=0.0)
                v_scales = tl.load(v_scale_head + scale_rows, mask=key_mask, other=0.0)
            else:
                k_scales = tl.load(k_scale_head + scale_rows)
                v_scales = tl.load(v_scale_head + scale_rows)
            scores = scores * k_scales[None, :]
            v = v.to(tl.float32) * v_scales[:, None]
        v = v.to(q.dtype)
        if IS_DIAGONAL:
            scores = tl.where(positions[None, :] <= q_positions[:, None], scores, float("-inf"))
        # The first tile of any row's range contains key 0, visible to all rows: m_new stays finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# The block table's width changes from batch to batch: Triton would compile a variant for width 1
# and for multiples of 16 (its integer specialisations), in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt_seq"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_s_block, stride_s_tok, stride_s_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    # Last query tiles first: they see the longest context, so the long programs start early.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_token = tile * BLOCK_Q
    if first_token >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len  # tokens before this chunk

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tokens = first_token + rows // GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tokens < query_len)
    tokens = tl.minimum(tokens, query_len - 1)  # padding rows repeat a real token: finite, never stored
    heads = kv_head * GROUP + rows % GROUP
    token_index = (query_start + tokens).to(tl.int64)
    q = tl.load(q_ptr + token_index[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :])
    if not IS_FP8:  # the dots run in the cache's dtype, or in q's for an fp8 cache
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_positions = context_len + tokens

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    k_scale_head = k_scale_ptr + kv_head * stride_s_head
    v_scale_head = v_scale_ptr + kv_head * stride_s_head
    first_position = context_len + first_token
    last_position = context_len + tl.minimum(first_token + BLOCK_Q, query_len) - 1
    # Whole tiles at or below the tile's first query position are visible to all its rows. With
    # ONE_PASS every tile takes the masked path: a row's sums then never depend on where its query
    # tile starts (the compiled unmasked path may round differently), the batch-invariant mode's need.
    diagonal_start = 0 if ONE_PASS else (first_position + 1) // BLOCK_N * BLOCK_N
    if not ONE_PASS:
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_positions, k_head, v_head, k_scale_head, v_scale_head,
                                      table, 0, diagonal_start, scale_log2, stride_k_block, stride_k_tok,
                                      stride_v_block, stride_v_tok, stride_s_block, stride_s_tok, HEAD_DIM,
                                      BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, IS_FP8)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_positions, k_head, v_head, k_scale_head, v_scale_head, table,
                                  diagonal_start, last_position + 1, scale_log2, stride_k_block, stride_k_tok,
                                  stride_v_block, stride_v_tok, stride_s_block, stride_s_tok, HEAD_DIM, BLOCK_SIZE,
                                  BLOCK_N, True, DOT_PRECISION, IS_FP8)
    out_tile = acc / l_i[:, None]
    o = out_ptr + token_index[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(o, out_tile.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                  out: torch.Tensor | None = None, *, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, max_block_m: int = PREFILL_MAX_BLOCK_M,
                  block_n: int = PREFILL_BLOCK_N, num_warps: int | None = None,
                  num_stages: int = PREFILL_NUM_STAGES, one_pass: bool = False) -> torch.Tensor:
    """Causal attention of packed query tokens over their sequences' paged contexts.

    q: [num_tokens, num_heads, head_dim], tokens of sequence s at query_start_loc[s]..[s+1]-1, the
    last positions of its seq_lens[s]-long context; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int32. max_query_len (a host int)
    sizes the grid. Sequences with query_len 0 are skipped. out is allocated when None. k_scale,
    v_scale: an fp8 cache's per-head-vector scales, float32 [num_blocks, block_size, num_kv_heads]
    (kv_quant; None otherwise).
    max_block_m, block_n, num_warps (None: by tile size), num_stages: tuning knobs (see the bench).
    one_pass: every K/V tile through the masked path (the batch-invariant backend's choice, triton_invariant).
    Launches only, no host sync.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = attention_group(q, k_cache, v_cache)
    k_scale, v_scale, scale_strides = scale_operands(k_cache, k_scale, v_scale)
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    if compute_dtype(q, k_cache).itemsize > 2:
        # float32 (tests, references): 128-row tiles three stages deep would need ~225 KiB of shared memory.
        max_block_m, num_stages = min(max_block_m, 64), min(num_stages, 2)
    block_m = min(max_block_m, max(16, triton.next_power_of_2(max_query_len * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        k_scale, v_scale, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=block_n, DOT_PRECISION=dot_precision(compute_dtype(q, k_cache)), IS_FP8=is_fp8(k_cache.dtype),
        ONE_PASS=one_pass, num_warps=num_warps or (8 if block_m >= 128 and head_dim >= 128 else 4),
        num_stages=num_stages,
    )
    return out
