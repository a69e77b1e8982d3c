"""Paged decode attention (one query token per sequence), split-K / flash-decoding, in Triton.

Grid (num_kv_heads, num_seqs, num_splits), the sequences taken in the order the caller gives
(AttentionMetadata.decode_order: longest first, so that no long sequence starts last and runs alone
on an emptying device; 0.92x the time of batch order for an fp8 cache at 256 random lengths,
bench/results/2026-12-07-h100-decode-order.md). A program loads the GROUP query heads that share one KV
head as the rows of one tile, so each K/V tile is read from memory once per KV head and not once
per query head, and streams its share of the sequence's context through the block table in tiles
of BLOCK_N tokens x head_dim (each token's head_dim row is contiguous: 16-byte, coalesced loads).
Scores and the online softmax are float32 in the log2 domain (log2(e) folded into the scale, exp2).
An fp8 cache (kv_quant) is widened to float16 on load (one conversion instruction per two values
on sm_89+, which bfloat16 lacks; V's in registers: triton_common.widen_fp8_in_registers),
with q's rows divided by their largest magnitude into float16's range: each score column is then
multiplied by its token's K scale (and each row by its q scale), and each probability column by
its token's V scale relative to the tile's largest before the second dot (so no probability that
matters falls into float16's subnormals), that largest applied after it.

With one split the kernel normalizes and writes the output directly. With several, each program
writes its normalized partial output and log2-sum-exp to a float32 workspace and counts itself done
on its (sequence, KV head)'s counter (an int32 buffer beside it); the program that finds itself the
last merges the splits that hold tokens and resets the counter to zero (split-K with a semaphore: one
launch a layer instead of a second, merging kernel; bench/results/2026-12-02-h200-fusions.md).
Every sequence's context is cut into num_splits equal pieces inside the kernel (from its own
seq_len), so the grid, the workspace and the launch depend only on num_seqs and num_splits: a CUDA
graph captured once replays correctly for any context lengths. Splits beyond a short sequence's
context (and sequences with seq_len 0, e.g. graph padding) write neutral partials (lse = -inf,
output 0) and are left out of the merge.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_service.attention.kv_quant import is_fp8
from worker_service.attention.triton_common import (
    H200_NUM_SMS,
    LOG2E,
    attention_group,
    compute_dtype,
    dot_precision,
    scale_operands,
    widen_fp8_in_registers,
)
from worker_service.attention.triton_paging import load_page_ids, token_offsets
from worker_service.layers.fused_kernels import num_sms
from worker_service.layers.triton_pdl import pdl_options, wait_for_previous_kernel

DECODE_BLOCK_N = 64  # context tokens per tile: 16 KiB of K (and of V) per tile at head_dim 128 in bf16
DECODE_NUM_WARPS = 4
# An fp8 cache's tile is half the bytes for the same work, and the work between its loads (the
# scores' and probabilities' reductions across warps, the widening of V) is what bounds the kernel:
# two warps a program reduce across fewer warps (ncu profile and sweep in
# bench/results/2026-12-01-h200-fp8-decode-warps.txt: 64 tokens and 2 warps 9 % faster than 128
# tokens and 4 at 256 x 1024 and 64 x 4096; 12 % with the per-column row sums).
FP8_DECODE_NUM_WARPS = 2
DECODE_NUM_STAGES = 3  # next tile's K/V in flight while this one computes (>= 3 needed: see triton_paging)
# Decode programs a split grid gives each multiprocessor: all of them resident at once, none in a second
# wave that waits for the first. A bf16 program's three stages of 64-token K/V tiles take 70 KB of shared
# memory (Triton 3.6 for sm_90; tests/worker_service/test_triton_kernels_compile.py checks that PROGRAMS_PER_SM
# fit), so three fit in an H200 multiprocessor's 228 KB if registers allow;
# measured at one sequence of 32k (bench/results/2026-12-03-h200-decode-chain.md): 64 splits (512
# programs) 62.1 us a layer of a 0.6B decode step, 33 splits (264) 57.6, 24-32 splits the sweep's best.
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write, merge) dominates
MAX_NUM_SPLITS = 64


# Per-batch values, not compile-time ones (Triton would otherwise compile a variant for 1 and for
# multiples of 16 of each while serving).
@triton.jit(do_not_specialize=["num_splits", "stride_bt_seq"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, order_ptr, out_ptr, partial_out_ptr,
    partial_lse_ptr, counters_ptr, k_scale_ptr, v_scale_ptr, scale_log2, num_splits, num_kv_heads,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_s_block, stride_s_tok, stride_s_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, BLOCK_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_FP8: tl.constexpr, WIDEN_V_IN_REGISTERS: tl.constexpr, HAS_ORDER: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        wait_for_previous_kernel()
    kv_head = tl.program_id(0)  # a sequence's KV heads run side by side: they read adjacent bytes
    if HAS_ORDER:
        seq = tl.load(order_ptr + tl.program_id(1))
    else:
        seq = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Equal pieces rounded up to whole tiles, so that tiles never straddle two splits.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)  # query heads of this KV head's group, padded to a dot-friendly size
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    k_scale_head = k_scale_ptr + kv_head * stride_s_head
    v_scale_head = v_scale_ptr + kv_head * stride_s_head
    acc, m_i, l_i = _split_attention(q, scale_log2, k_head, v_head, k_scale_head, v_scale_head, table, start, end,
                                     stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, stride_s_block,
                                     stride_s_tok, BLOCK_H, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, IS_FP8,
                                     WIDEN_V_IN_REGISTERS, k_cache_ptr.dtype.element_ty)

    is_nonempty = l_i > 0.0
    out_tile = acc / tl.where(is_nonempty, l_i, 1.0)[:, None]  # an empty range gives 0, not NaN
    if IS_SPLIT:
        lse = tl.where(is_nonempty, m_i + tl.log2(l_i), float("-inf"))
        po = partial_out_ptr + seq.to(tl.int64) * stride_po_seq
        tl.store(po + split * stride_po_split + heads[:, None] * stride_po_head + dims[None, :], out_tile,
                 mask=row_mask[:, None])
        pl = partial_lse_ptr + seq.to(tl.int64) * stride_pl_seq
        tl.store(pl + split + heads * stride_pl_head, lse, mask=row_mask)
        # Every thread's stores before the count (the barrier), the count a release and an acquire at
        # GPU scope, so the last program's loads (L2, .cg: not a stale L1 line) see every split's.
        tl.debug_barrier()
        counter = counters_ptr + seq * num_kv_heads + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # ready for the next launch (the next layer, the next graph replay)
            o = out_ptr + seq.to(tl.int64) * stride_o_tok
            # Only the splits that hold tokens: a CUDA graph's grid has splits for the longest context.
            num_filled = tl.cdiv(seq_len, tl.maximum(split_len, 1))
            for row in tl.static_range(GROUP):
                head = kv_head * GROUP + row
                merged = _merge_head(po + head * stride_po_head, pl + head * stride_pl_head, num_filled,
                                     stride_po_split, HEAD_DIM, BLOCK_SPLITS)
                tl.store(o + head * stride_o_head + dims, merged.to(out_ptr.dtype.element_ty))
    else:
        o = out_ptr + seq.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(o, out_tile.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _split_attention(q, scale_log2, k_head, v_head, k_scale_head, v_scale_head, table, start, end,
                     stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, stride_s_block, stride_s_tok,
                     BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_FP8: tl.constexpr,
                     WIDEN_V_IN_REGISTERS: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """Unnormalized output [BLOCK_H, HEAD_DIM], row max and row sum (log2 domain) of the query rows q
    over tokens start..end-1 of one KV head (an empty range: zeros, a max of -inf)."""
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    row_scale = tl.full([BLOCK_H], scale_log2, dtype=tl.float32)
    if not IS_FP8:  # the dots run in the cache's dtype, or in float16 for an fp8 cache
        q = q.to(CACHE_DTYPE)
    else:
        q_max = tl.max(tl.abs(q.to(tl.float32)), 1)
        q_max = tl.where(q_max > 0.0, q_max, 1.0)
        q = (q.to(tl.float32) / q_max[:, None]).to(tl.float16)
        row_scale = row_scale * q_max

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    # Each row's sum of probabilities, kept per column and summed once after the loop: a sum across
    # warps in every tile would cost a shared-memory round trip and barriers.
    l_cols = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    page_ids = load_page_ids(table, start, end, BLOCK_SIZE, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        col_mask = tile_start + cols < end
        k_rows = k_head + token_offsets(page_ids, tile_start, stride_k_block, stride_k_tok, BLOCK_SIZE, BLOCK_N)
        v_rows = v_head + token_offsets(page_ids, tile_start, stride_v_block, stride_v_tok, BLOCK_SIZE, BLOCK_N)
        if IS_FP8:
            scale_rows = token_offsets(page_ids, tile_start, stride_s_block, stride_s_tok, BLOCK_SIZE, BLOCK_N)
        page_ids = load_page_ids(table, tile_start + BLOCK_N, end, BLOCK_SIZE, BLOCK_N)  # next tile's, early
        k = tl.load(k_rows[:, None] + dims[None, :], mask=col_mask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_rows[:, None] + dims[None, :], mask=col_mask[:, None], other=0.0)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * row_scale[:, None]
        if IS_FP8:
            k_scales = tl.load(k_scale_head + scale_rows, mask=col_mask, other=0.0)
            v_scales = tl.load(v_scale_head + scale_rows, mask=col_mask, other=0.0)
            scores = scores * k_scales[None, :]
        v = widen_fp8_in_registers(v) if WIDEN_V_IN_REGISTERS else v.to(q.dtype)
        scores = tl.where(col_mask[None, :], scores, float("-inf"))
        # Every tile holds at least one real token (start < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_cols = l_cols * alpha[:, None] + p
        if IS_FP8:
            v_top = tl.max(v_scales, 0)
            v_top = tl.where(v_top > 0.0, v_top, 1.0)
            pv = tl.dot((p * (v_scales / v_top)[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv * v_top
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, tl.sum(l_cols, 1)


@triton.jit
def _merge_head(po_ptr, pl_ptr, num_filled, stride_po_split, HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """One head's output from its first num_filled splits' partial outputs (po_ptr) and log2-sum-exps
    (pl_ptr); zeros when there are none."""
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    split_mask = splits < num_filled
    lse = tl.load(pl_ptr + splits, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty: weights 0, output 0
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(po_ptr + splits[:, None] * stride_po_split + dims[None, :], mask=split_mask[:, None], other=0.0,
                    cache_modifier=".cg")
    total = tl.sum(weights, 0)
    return tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)


def decode_num_warps(fp8: bool) -> int:
    """Warps a decode program runs with, by the cache's element type."""
    return FP8_DECODE_NUM_WARPS if fp8 else DECODE_NUM_WARPS


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device | None = None) -> int:
    """KV splits per sequence: as many programs (num_seqs * num_kv_heads * splits) as the device holds at
    once (PROGRAMS_PER_SM on each multiprocessor), no more, and no split shorter than MIN_TOKENS_PER_SPLIT.

    For CUDA graphs call it once per captured batch size with max_seq_len = the model's maximum
    context, and pass the result as AttentionMetadata.decode_num_splits (correct for any actual
    lengths: the kernel cuts each sequence's own context into that many pieces).
    """
    sms = num_sms(device, H200_NUM_SMS) if device is not None else H200_NUM_SMS
    wanted = PROGRAMS_PER_SM * sms // max(1, num_seqs * num_kv_heads)
    useful = triton.cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_NUM_SPLITS))


def decode_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of scratch the split decode needs (0 when num_splits == 1)."""
    if num_splits <= 1:
        return 0
    return num_seqs * num_heads * num_splits * (head_dim + 1)


def decode_counters_numel(num_seqs: int, num_kv_heads: int, num_splits: int) -> int:
    """int32 counters the split decode needs, one per sequence and KV head (0 when num_splits == 1).
    Make them zero-filled once (torch.zeros): every launch leaves them at zero, so one buffer serves
    all layers, graphs and batch sizes."""
    return 0 if num_splits <= 1 else num_seqs * num_kv_heads


def new_decode_scratch(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                       device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A split decode's own workspace and zero-filled counters ((None, None) with one split), for callers
    that launch one shape repeatedly (benchmarks); the backend keeps shared ones instead."""
    if num_splits <= 1:
        return None, None
    return (torch.empty(decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits), device=device),
            torch.zeros(decode_counters_numel(num_seqs, num_kv_heads, num_splits), dtype=torch.int32, device=device))


def _checked_or_new(buffer: torch.Tensor | None, what: str, needed: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """buffer, checked to hold `needed` elements of dtype, or a zero-filled new one when None."""
    if buffer is None:
        return torch.zeros(needed, dtype=dtype, device=device)
    if buffer.numel() < needed or buffer.dtype != dtype:
        raise ValueError(f"decode {what} needs {needed} {dtype} elements, got {buffer.numel()} {buffer.dtype}")
    return buffer


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_splits: int, workspace: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, *, counters: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 order: torch.Tensor | None = None, block_n: int = DECODE_BLOCK_N, num_warps: int | None = None,
                 num_stages: int = DECODE_NUM_STAGES) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (context incl. the token).
    workspace: float32, at least decode_workspace_numel(...) elements, and counters: int32, zero-filled,
    at least decode_counters_numel(...), both needed when num_splits > 1 (allocated here when None;
    preallocate them for CUDA graph capture). out: [num_seqs, num_heads, head_dim], allocated when None.
    k_scale, v_scale: an fp8 cache's per-head-vector scales, float32 [num_blocks, block_size,
    num_kv_heads] (kv_quant; None otherwise). order: int32 [num_seqs], a permutation of the sequences
    in the order their programs should start (base.longest_first; None: batch order). block_n, num_warps,
    num_stages: tuning knobs (see the bench). Launches only, no host sync.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    fp8 = is_fp8(k_cache.dtype)
    group = attention_group(q, k_cache, v_cache)
    k_scale, v_scale, scale_strides = scale_operands(k_cache, k_scale, v_scale)
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    if order is not None and (order.shape != (num_seqs,) or order.dtype != torch.int32):
        raise ValueError(f"order must be int32 [{num_seqs}], got {order.dtype} {tuple(order.shape)}")
    if num_warps is None:
        num_warps = decode_num_warps(fp8)
    num_splits = max(1, min(int(num_splits), MAX_NUM_SPLITS))
    is_split = num_splits > 1
    if is_split:
        needed = decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits)
        workspace = _checked_or_new(workspace, "workspace", needed, torch.float32, q.device)
        counters = _checked_or_new(counters, "counters", decode_counters_numel(num_seqs, num_kv_heads, num_splits),
                                   torch.int32, q.device)
        split_area = num_seqs * num_heads * num_splits
        partial_out = workspace[:split_area * head_dim].view(num_seqs, num_heads, num_splits, head_dim)
        partial_lse = workspace[split_area * head_dim:split_area * (head_dim + 1)].view(num_seqs, num_heads,
                                                                                       num_splits)
    else:
        partial_out = partial_lse = counters = out  # unused by the kernel's IS_SPLIT=False branch
    _decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, order if order is not None else seq_lens, out, partial_out,
        partial_lse, counters, k_scale, v_scale, scale * LOG2E, num_splits, num_kv_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2) if is_split else 0,
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, IS_SPLIT=is_split,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        DOT_PRECISION=dot_precision(compute_dtype(q, k_cache)), IS_FP8=fp8,
        WIDEN_V_IN_REGISTERS=fp8 and q.is_cuda,  # inline PTX: not under the CPU interpreter
        HAS_ORDER=order is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(q.device),
    )
    return out
