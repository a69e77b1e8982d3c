"""The experts of a mixture-of-experts block on GPUs, as four Triton kernels (moe.KERNELS["experts"]).

Each token picked k experts (topk_ids [T, k]); the T * k (token, slot) pairs are the *entries*. A
dense loop would read every expert's weights once per entry; here the entries are grouped by expert
so that each expert's weights are read once per group:

1. `_align_kernel` (one program) counts the entries of each of this rank's experts, pads each count
   to a multiple of BLOCK_M, and writes `sorted_entries` (entry indices, expert by expert, each group
   padded with a sentinel) and `block_experts` (the expert of each BLOCK_M-row block, -1 past the
   last). Entries of experts on other ranks (tensor parallelism) go nowhere.
2. `_grouped_kernel` with GATE_UP: for each block, x's rows of its entries times the expert's gate and
   up rows (w13 [E, 2I, H]), SiLU(gate) * up in the epilogue -> `hidden` [T * k, I].
3. `_grouped_kernel` without GATE_UP: hidden's rows times the expert's down rows (w2 [E, H, I]),
   times the entry's routing weight -> `per_entry` [T * k, H]; `_combine_kernel` then sums each
   token's slots in slot order in float32 (slots of other ranks' experts skipped: never written).

Shapes are fixed by T, k and the block size alone (no host sync, no data-dependent allocation), so
the four launches are captured in decode CUDA graphs. The block sizes are a function of the shape
(`moe_config`), not autotuned. A row's result does not depend on where in its block it sits, and the
slots are summed in a fixed order, so the output does not depend on the order of entries in a group.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 1024  # entries the align kernel takes per step
BLOCKS_CHUNK = 64  # blocks it names per step (a [BLOCKS_CHUNK, NUM_BINS] comparison)
MAX_TOKENS_PER_CALL = 4096  # larger inputs go in slices, bounding hidden and per_entry's memory
COMBINE_BLOCK = 1024


class MoeConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# --deterministic's one configuration for every batch: a row's sums over K then take the same tiles and
# instructions whatever else the step holds (and a row's result never depends on its place in a block).
INVARIANT_CONFIG = MoeConfig(16, 32, 64, 4, 3)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_experts_ptr, cursor_ptr, num_entries, first_expert, num_local,
                  max_padded, max_blocks, BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr):
    bins = tl.arange(0, NUM_BINS)  # bin NUM_BINS - 1 (> every local expert) collects the other ranks' entries
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_entries, CHUNK):
        entries = start + tl.arange(0, CHUNK)
        local = tl.load(ids_ptr + entries, mask=entries < num_entries, other=-1).to(tl.int32) - first_expert
        local = tl.where((local >= 0) & (local < num_local) & (entries < num_entries), local, NUM_BINS - 1)
        counts += tl.histogram(local, NUM_BINS)
    padded = tl.where(bins < num_local, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded)
    total = tl.sum(padded, 0)
    for start in range(0, max_blocks, BLOCKS_CHUNK):
        blocks = start + tl.arange(0, BLOCKS_CHUNK)
        first_row = blocks * BLOCK_M
        # A block's expert: the first one whose padded group ends after the block's first row.
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(first_row < total, expert, -1), mask=blocks < max_blocks)
    for start in range(0, max_padded, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, num_entries, mask=rows < max_padded)
    tl.debug_barrier()  # the cursors and sentinels are written before any entry takes a place
    for start in range(0, num_entries, CHUNK):
        entries = start + tl.arange(0, CHUNK)
        local = tl.load(ids_ptr + entries, mask=entries < num_entries, other=-1).to(tl.int32) - first_expert
        mine = (local >= 0) & (local < num_local) & (entries < num_entries)
        place = tl.atomic_add(cursor_ptr + local, 1, mask=mine)
        tl.store(sorted_ptr + place, entries, mask=mine)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_experts_ptr, weights_ptr, num_entries, N, K,
                    stride_a_row, stride_w_expert, stride_w_row, stride_out_row, max_blocks,
                    TOP_K: tl.constexpr, GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Blocks vary fastest: the blocks of one expert, adjacent, read the same weight tile from L2.
    block = tl.program_id(0) % max_blocks
    column_tile = tl.program_id(0) // max_blocks
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:
        return
    entries = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    real = entries < num_entries
    # GATE_UP reads x's row of the entry's token; the down product reads hidden's row of the entry.
    a_rows = (entries // TOP_K if GATE_UP else entries).to(tl.int64)
    columns = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(columns, N - 1).to(tl.int64)  # past N: re-read row N - 1, not stored
    w_base = w_ptr + expert.to(tl.int64) * stride_w_expert
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + ks) < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a_row + (k + ks)[None, :], mask=real[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + w_rows[None, :] * stride_w_row + (k + ks)[:, None], mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:  # the up rows sit N rows below the gate rows
            up = tl.load(w_base + (w_rows + N)[None, :] * stride_w_row + (k + ks)[:, None], mask=k_mask[:, None],
                         other=0.0)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
    out_type = out_ptr.dtype.element_ty
    if GATE_UP:  # rounded as the unfused gate/up product and silu_and_mul round
        gate = acc.to(out_type).to(tl.float32)
        result = (gate / (1.0 + tl.exp(-gate))).to(out_type).to(tl.float32) * acc_up.to(out_type).to(tl.float32)
    else:
        result = acc.to(out_type).to(tl.float32) * tl.load(weights_ptr + entries, mask=real, other=0.0)[:, None]
    out_ptrs = out_ptr + entries.to(tl.int64)[:, None] * stride_out_row + columns[None, :]
    tl.store(out_ptrs, result.to(out_type), mask=real[:, None] & (columns < N)[None, :])


@triton.jit
def _combine_kernel(per_entry_ptr, ids_ptr, out_ptr, first_expert, num_local, H, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):
    """out[t] = the sum of per_entry's rows of t's slots in slot order (float32, one rounding), skipping
    slots of other ranks' experts (their rows were never written)."""
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + token * TOP_K + slot).to(tl.int32) - first_expert
        if (local >= 0) & (local < num_local):
            row = tl.load(per_entry_ptr + (token * TOP_K + slot) * H + columns, mask=columns < H, other=0.0)
            acc += row.to(tl.float32)
    tl.store(out_ptr + token * H + columns, acc.to(out_ptr.dtype.element_ty), mask=columns < H)


def moe_config(num_entries: int, num_local_experts: int, dtype: torch.dtype = torch.bfloat16) -> MoeConfig:
    """Block sizes from the shape alone: BLOCK_M near the entries an expert gets on average (decode
    batches give few), so that little of each block is padding; small column tiles at few rows, so
    that a decode step's few blocks still make hundreds of programs to read the weights at bandwidth.
    From bench/moe_bench.py --sweep on an H200 at Qwen3-30B-A3B's shapes (bench/results/2026-12-02-h200-moe.md).
    float32 (tests, references) takes half the K tile and fewer stages: its tiles are twice the bytes."""
    per_expert = num_entries / max(num_local_experts, 1)
    if per_expert <= 8:
        config = MoeConfig(16, 32, 128, 4, 4)
    elif per_expert <= 32:
        config = MoeConfig(32, 64, 128, 4, 4)
    elif per_expert <= 128:
        config = MoeConfig(64, 128, 64, 4, 4)
    else:
        config = MoeConfig(128, 128, 64, 8, 3)
    if dtype == torch.float32:
        config = config._replace(block_k=config.block_k // 2, num_stages=2)
    return config


def max_blocks(num_entries: int, num_local_experts: int, block_m: int) -> int:
    """Blocks the padded groups can take at most: each non-empty group adds under one block of padding,
    and there are no more groups than entries."""
    return min(num_entries, triton.cdiv(num_entries, block_m) + num_local_experts)


def align(topk_ids: torch.Tensor, first_expert: int, num_local: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_entries, block_experts) for topk_ids [T, k] (see the module docstring)."""
    num_entries = topk_ids.numel()
    blocks = max_blocks(num_entries, num_local, block_m)
    num_bins = triton.next_power_of_2(num_local + 1)
    sorted_entries = torch.empty(blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=topk_ids.device)
    cursor = torch.empty(num_bins, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_entries, block_experts, cursor, num_entries, first_expert,
                        num_local, blocks * block_m, blocks, BLOCK_M=block_m, NUM_BINS=num_bins, CHUNK=ALIGN_CHUNK,
                        BLOCKS_CHUNK=BLOCKS_CHUNK, num_warps=8)
    return sorted_entries, block_experts


def invariant_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, first_expert: int) -> torch.Tensor:
    """fused_experts with INVARIANT_CONFIG: batch-invariant (worker_service.invariant)."""
    return fused_experts(x, w13, w2, topk_ids, topk_weights, first_expert, INVARIANT_CONFIG)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, first_expert: int, config: MoeConfig | None = None) -> torch.Tensor:
    """moe.KERNELS["experts"] on CUDA tensors: sum over the k slots of routing weight times
    expert(x) for this rank's experts ([first_expert, first_expert + E_local)), others add nothing.
    x [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; topk_ids [T, k] global expert ids;
    topk_weights [T, k] float32. Returns [T, H] in x's dtype. `config` overrides moe_config (benchmarks)."""
    if x.shape[0] > MAX_TOKENS_PER_CALL:
        return torch.cat([fused_experts(x[start:start + MAX_TOKENS_PER_CALL], w13, w2,
                                        topk_ids[start:start + MAX_TOKENS_PER_CALL],
                                        topk_weights[start:start + MAX_TOKENS_PER_CALL], first_expert, config)
                          for start in range(0, x.shape[0], MAX_TOKENS_PER_CALL)])
    num_tokens, top_k = topk_ids.shape
    topk_ids = topk_ids.contiguous()  # the kernels index it as [T, k] rows
    num_local, two_i, hidden_size = w13.shape
    inter = two_i // 2
    num_entries = num_tokens * top_k
    if num_entries == 0:
        return x.new_zeros(x.shape)
    config = config or moe_config(num_entries, num_local, x.dtype)
    x = x.contiguous()
    sorted_entries, block_experts = align(topk_ids, first_expert, num_local, config.block_m)
    blocks = block_experts.numel()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # ignored for 16-bit operands
    options = dict(TOP_K=top_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                   DOT_PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages)
    hidden = torch.empty(num_entries, inter, dtype=x.dtype, device=x.device)
    _grouped_kernel[(blocks * triton.cdiv(inter, config.block_n),)](
        x, w13, hidden, sorted_entries, block_experts, weights, num_entries, inter, hidden_size, x.stride(0),
        w13.stride(0), w13.stride(1), hidden.stride(0), blocks, GATE_UP=True, **options)
    per_entry = torch.empty(num_entries, hidden_size, dtype=x.dtype, device=x.device)
    _grouped_kernel[(blocks * triton.cdiv(hidden_size, config.block_n),)](
        hidden, w2, per_entry, sorted_entries, block_experts, weights, num_entries, hidden_size, inter,
        hidden.stride(0), w2.stride(0), w2.stride(1), per_entry.stride(0), blocks, GATE_UP=False, **options)
    out = torch.empty_like(x)
    _combine_kernel[(num_tokens, triton.cdiv(hidden_size, COMBINE_BLOCK))](
        per_entry, topk_ids, out, first_expert, num_local, hidden_size, TOP_K=top_k, BLOCK=COMBINE_BLOCK)
    return out
