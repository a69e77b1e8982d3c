"""Batch-invariant y = x W^T (+ b) on GPUs, as one Triton kernel: each row's result is the same bits
whatever the other rows are, however many there are, and at any tensor-parallel size.

cuBLAS chooses its algorithm (tile shapes, split-K, stream-K) by the problem's shape, so a row's
sums are reduced in an order that depends on how many rows came with it; the skinny decode kernel
(layers/triton_skinny_matmul) sums in yet another order. Here the order is a function of K alone:

- K splits into segments of SEGMENT columns (a whole multiple of BLOCK_K); inside a segment the
  products accumulate in float32 through tl.dot over BLOCK_K steps, from zero; the segments' sums are
  then added in segment order, in float32, and the bias last. Nothing in that order depends on M.
- A program either walks all segments itself (large M: enough programs anyway), or computes one
  segment and writes its float32 partial, and `_sum_segments_kernel` adds the partials in the same
  order (small M: segments become parallel work, like split-K, without atomics). Both give the same
  bits (tested), so the choice can follow M.
- A row-parallel layer over N ranks (o_proj, down_proj) holds K / N columns: whole segments. Each
  rank writes its segments' partials, the partials are gathered (rank order is segment order), and
  every rank adds all of them in order: the sum of TP = 1, exactly.

The tile shapes depend on M (BLOCK_M) but not the reduction: the tests check that a row's result is
identical at every BLOCK_M this module uses (the tensor cores' products and their float32 sums per
k-step do not depend on the tile's other rows), and at every M from 1 to thousands.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from worker_service.layers.linear import compose_normed_linear
from worker_service.layers.norm import RMSNorm
from worker_service.parallel.distributed import all_gather_rows, tp_size

SEGMENT = 128  # columns of K per segment: K / tensor_parallel_size must be a multiple (whole segments per rank)
BLOCK_K = 64
BLOCK_N = 128
# Below this many (M tile, N tile) programs, segments run in parallel (partials + _sum_segments_kernel),
# when the partials (4 bytes x segments x M x N) stay small beside the weight (2 bytes x K x N): M <= 64.
MIN_PROGRAMS = 264  # two per multiprocessor of an H100/H200
MAX_SPLIT_ROWS = 64


@triton.jit
def _segment_sum(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start, K, stride_x, stride_w,
                 SEGMENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """The float32 sum over columns k_start .. k_start + SEGMENT - 1 (< K) of x[rows] * w[cols], from zero."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_start + SEGMENT, BLOCK_K):
        k_mask = (k + ks) < K
        a = tl.load(x_ptr + rows[:, None] * stride_x + (k + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_w + (k + ks)[:, None], mask=col_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                   HAS_BIAS: tl.constexpr, PARTIALS: tl.constexpr, SEGMENT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """PARTIALS: program (m, n, segment) writes that segment's float32 sum to out[segment] ([S, M, N]);
    else program (m, n) adds all segments in order (+ bias) and writes out [M, N] in its dtype."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if PARTIALS:
        segment = tl.program_id(2)
        partial = _segment_sum(x_ptr, w_ptr, rows64, cols64, row_mask, col_mask, segment * SEGMENT, K,
                               stride_x, stride_w, SEGMENT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        target = out_ptr + segment.to(tl.int64) * M * N + rows64[:, None] * N + cols64[None, :]
        tl.store(target, partial, mask=out_mask)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, K, SEGMENT):
            total += _segment_sum(x_ptr, w_ptr, rows64, cols64, row_mask, col_mask, k_start, K, stride_x,
                                  stride_w, SEGMENT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        target = out_ptr + rows64[:, None] * stride_out + cols64[None, :]
        tl.store(target, total.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_segments_kernel(partials_ptr, bias_ptr, out_ptr, numel, N, num_segments, stride_out,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = partials[0] + partials[1] + ... (+ bias), in that order, in float32 (as _matmul_kernel)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for segment in range(num_segments):
        total += tl.load(partials_ptr + segment * numel + offsets, mask=mask, other=0.0)
    cols = offsets % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offsets // N) * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def block_m_for(m: int) -> int:
    """The row tile: the smallest of 16, 32, 64, 128 that holds m rows (the reduction does not depend on it)."""
    return min(128, max(16, triton.next_power_of_2(m)))


def segment_length(k: int) -> int:
    """SEGMENT where K is made of whole segments, else K itself (one segment: tiny test shapes)."""
    return SEGMENT if k % SEGMENT == 0 else k


def _block_k(segment: int) -> int:
    return min(BLOCK_K, max(16, triton.next_power_of_2(segment)))


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit operands


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    n, k = weight.shape
    if weight.stride(-1) != 1:
        raise ValueError("invariant linear needs the weight's rows contiguous")
    if x.shape[-1] != k or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} for a weight {tuple(weight.shape)} {weight.dtype}")
    return n, k


def segment_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[K / segment, M, N] float32: each segment's sum, from zero (what ranks gather for a row-parallel layer)."""
    n, k = _check(x, weight)
    rows = _rows(x, k)
    m = rows.shape[0]
    segment = segment_length(k)
    partials = torch.empty((k // segment, m, n), dtype=torch.float32, device=x.device)
    if m and n:
        block_m = block_m_for(m)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N), k // segment)
        _matmul_kernel[grid](rows, weight, weight, partials, m, n, k, rows.stride(0), weight.stride(0), n,
                             HAS_BIAS=False, PARTIALS=True, SEGMENT=segment, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                             BLOCK_K=_block_k(segment), DOT_PRECISION=_dot_precision(x.dtype),
                             num_warps=4, num_stages=3)
    return partials


def sum_segments(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = the partials [S, M, N] added in order (+ bias), rounded once to out's dtype."""
    num_segments, m, n = partials.shape
    numel = m * n
    if numel:
        block = 1024
        _sum_segments_kernel[(triton.cdiv(numel, block),)](
            partials, bias if bias is not None else partials, out, numel, n, num_segments, out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def _output(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (*x.shape[:-1], n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype}, expected contiguous {(*x.shape[:-1], n)} {x.dtype}")
    return out.view(m, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b), batch-invariant (linear.KERNELS["linear"] under --deterministic on GPUs)."""
    n, k = _check(x, weight)
    rows = _rows(x, k)
    m = rows.shape[0]
    product = _output(x, n, out)
    segment = segment_length(k)
    block_m = block_m_for(m)
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N)
    if m and n and programs < MIN_PROGRAMS and m <= MAX_SPLIT_ROWS and k > segment:
        sum_segments(segment_partials(rows, weight), bias, product)
    elif m and n:
        _matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))](
            rows, weight, bias if bias is not None else weight, product, m, n, k, rows.stride(0), weight.stride(0),
            product.stride(0), HAS_BIAS=bias is not None, PARTIALS=False, SEGMENT=segment, BLOCK_M=block_m,
            BLOCK_N=BLOCK_N, BLOCK_K=_block_k(segment), DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=8 if block_m >= 128 else 4, num_stages=3)
    return product.view(*x.shape[:-1], n)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel layer's output (linear.KERNELS["row_linear"]): this rank's segments' partials,
    gathered from every rank in rank order, added in that order; at one rank, `linear`."""
    if tp_size() == 1:
        return linear(x, weight, bias)
    n, k = _check(x, weight)
    if segment_length(k) != SEGMENT:
        raise ValueError(f"--deterministic with tensor parallelism: each rank's input width {k} must be a "
                         f"multiple of {SEGMENT}")
    partials = all_gather_rows(segment_partials(x, weight)).flatten(0, 1)
    product = _output(x, n, None)
    return sum_segments(partials, bias, product).view(*x.shape[:-1], n)


def normed_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                  layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm (one program per row: invariant) and then the layer, which calls `linear`."""
    return compose_normed_linear(x, residual, norm, layer)
