"""Batch-invariant y = x W^T (+ b) on GPUs, as Triton kernels: each row's result is the same bits
whatever the other rows are, however many there are, and at any tensor-parallel size.

cuBLAS chooses its algorithm (tile shapes, split-K, stream-K) by the problem's shape, so a row's
sums are reduced in an order that depends on how many rows came with it; the skinny decode kernel
(layers/triton_skinny_matmul) sums in yet another order. Here the order is a function of K alone:

- `linear` (column-parallel layers and the head: ranks split N, never K): each output is one tl.dot
  chain over K in BLOCK_K steps, from zero, in float32, the bias added last.
- `segmented_linear` / `row_linear` (o_proj, down_proj, whose ranks split K): K splits into segments
  of SEGMENT columns; each segment's sum is a chain from zero, and the segments' sums are added in
  segment order. A program walks all segments itself (many rows), or computes one segment and writes
  its float32 partial for `_sum_segments_kernel` to add in the same order (<= 64 rows: segments become
  parallel work, like split-K, without atomics); both give the same bits. Over N ranks each rank holds
  whole segments, writes their partials, the partials are gathered (rank order is segment order) and
  every rank adds all of them in order: the sums of one rank, exactly.

The tile shapes depend on M but not the reduction: the tests check that a row's result is identical at
every row tile this module uses (the tensor cores' products and their float32 sums per k-step do not
depend on the tile's other rows), and at every M from 1 to thousands. The chain is the faster of the
two (its loop pipelines without a wait at each segment's end: bench/invariant_matmul_bench.py).
"""
from __future__ import annotations

from typing import NamedTuple

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
NUM_STAGES = 3
# Below this many (M tile, N tile) programs, segments run in parallel (partials + _sum_segments_kernel),
# when the partials (4 bytes x segments x M x N) stay small beside the weight (2 bytes x K x N): M <= 64.
MIN_PROGRAMS = 264  # two per multiprocessor of an H100/H200
MAX_SPLIT_ROWS = 64


@triton.jit
def _load_tiles(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k, K, stride_x, stride_w, EVEN_K: tl.constexpr):
    """x[rows, k] and w[cols, k]^T, zero outside the matrices (K's edge only when not EVEN_K)."""
    x_tile = x_ptr + rows[:, None] * stride_x + k[None, :]
    w_tile = w_ptr + cols[None, :] * stride_w + k[:, None]
    if EVEN_K:
        return (tl.load(x_tile, mask=row_mask[:, None], other=0.0),
                tl.load(w_tile, mask=col_mask[None, :], other=0.0))
    return (tl.load(x_tile, mask=row_mask[:, None] & (k < K)[None, :], other=0.0),
            tl.load(w_tile, mask=col_mask[None, :] & (k < K)[:, None], other=0.0))


@triton.jit
def _segment_sum(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start, K, stride_x, stride_w,
                 SEGMENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The float32 sum over columns k_start .. k_start + SEGMENT - 1 (< K) of x[rows] * w[cols], from
    zero. Unrolled (static_range), so that the caller's loop over segments is the one Triton pipelines:
    the next segment's tiles load while this one's multiply."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in tl.static_range(0, SEGMENT, BLOCK_K):
        a, b = _load_tiles(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start + step + ks, K, stride_x, stride_w,
                           EVEN_K)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _chain_sum(x_ptr, w_ptr, rows, cols, row_mask, col_mask, K, stride_x, stride_w, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The float32 sum over all K columns, one tl.dot chain of BLOCK_K steps (one pipelined loop)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        a, b = _load_tiles(x_ptr, w_ptr, rows, cols, row_mask, col_mask, k_start + ks, K, stride_x, stride_w, EVEN_K)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                   HAS_BIAS: tl.constexpr, CHAIN: tl.constexpr, PARTIALS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   SEGMENT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """CHAIN: program (m, n) sums all of K in one chain (+ bias), writes out [M, N] in its dtype.
    PARTIALS: program (m, n, segment) writes that segment's float32 sum to out[segment] ([S, M, N]);
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
                               stride_x, stride_w, SEGMENT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        target = out_ptr + segment.to(tl.int64) * M * N + rows64[:, None] * N + cols64[None, :]
        tl.store(target, partial, mask=out_mask)
    else:
        if CHAIN:
            total = _chain_sum(x_ptr, w_ptr, rows64, cols64, row_mask, col_mask, K, stride_x, stride_w, BLOCK_M,
                               BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
        else:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k_start in range(0, K, SEGMENT):
                total += _segment_sum(x_ptr, w_ptr, rows64, cols64, row_mask, col_mask, k_start, K, stride_x,
                                      stride_w, SEGMENT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION)
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


class TileConfig(NamedTuple):
    """How a launch tiles the product; none of it changes a row's sums (the tests hold it to that)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def tile_config(m: int) -> TileConfig:
    """The row tile: the smallest of 16, 32, 64, 128 that holds m rows; 8 warps at 128 rows."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    return TileConfig(block_m, BLOCK_N, 8 if block_m >= 128 else 4, NUM_STAGES)


def segmented_config(m: int, dtype: torch.dtype) -> TileConfig:
    """tile_config for the segmented kernel, which loads two k-steps a pipeline stage."""
    config = tile_config(m)
    if dtype.itemsize > 2:  # float32: 128 x 128 tiles, two steps a stage, would not fit in shared memory
        return config._replace(block_n=64, num_stages=2)
    if config.block_m == 128 and m <= 256:  # faster at decode sizes on an H200 (bench/invariant_matmul_bench)
        return config._replace(block_n=64, num_stages=4)
    return config


def segment_length(k: int) -> int:
    """SEGMENT where K is made of whole segments, else K itself (one segment: tiny test shapes)."""
    return SEGMENT if k % SEGMENT == 0 else k


def chain_config(m: int, n: int) -> TileConfig:
    """tile_config, with narrower column tiles where few row tiles would leave most multiprocessors idle."""
    config = tile_config(m)
    if triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n) < MIN_PROGRAMS:
        return config._replace(block_n=64)
    return config


def _reduction_constexprs(segment: int, dtype: torch.dtype) -> dict[str, int | bool | str]:
    """What fixes the order of a row's sums: the segment (K itself for a chain), the k-step, fp32's dot
    precision."""
    block_k = min(BLOCK_K, max(16, triton.next_power_of_2(segment)))
    return dict(SEGMENT=segment, BLOCK_K=block_k, EVEN_K=segment % block_k == 0,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")  # ignored for 16-bit operands


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    n, k = weight.shape
    if weight.stride(-1) != 1:
        raise ValueError("invariant linear needs the weight's rows contiguous")
    if x.shape[-1] != k or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} for a weight {tuple(weight.shape)} {weight.dtype}")
    return n, k


def segment_partials(x: torch.Tensor, weight: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """[K / segment, M, N] float32: each segment's sum, from zero (what ranks gather for a row-parallel layer)."""
    n, k = _check(x, weight)
    rows = _rows(x, k)
    m = rows.shape[0]
    segment = segment_length(k)
    partials = torch.empty((k // segment, m, n), dtype=torch.float32, device=x.device)
    if m and n:
        config = config or segmented_config(m, x.dtype)._replace(num_warps=4)
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), k // segment)
        _matmul_kernel[grid](rows, weight, weight, partials, m, n, k, rows.stride(0), weight.stride(0), n,
                             HAS_BIAS=False, CHAIN=False, PARTIALS=True, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                             **_reduction_constexprs(segment, x.dtype), num_warps=config.num_warps,
                             num_stages=config.num_stages)
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
           out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """x W^T (+ b), batch-invariant, each output one tl.dot chain over all of K (linear.KERNELS["linear"]
    under --deterministic on GPUs: column-parallel layers, whose ranks split N, not K, and the head).
    config: the tiling (default chain_config(M); the benchmark sweeps it)."""
    n, k = _check(x, weight)
    rows = _rows(x, k)
    m = rows.shape[0]
    product = _output(x, n, out)
    config = config or chain_config(m, n)
    if m and n:
        _launch_product(rows, weight, bias, product, config, chain=True)
    return product.view(*x.shape[:-1], n)


def segmented_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """x W^T (+ b) summed segment by segment (a row-parallel layer at one rank: the sums of any rank count)."""
    n, k = _check(x, weight)
    rows = _rows(x, k)
    m = rows.shape[0]
    product = _output(x, n, out)
    segment = segment_length(k)
    config = config or segmented_config(m, x.dtype)
    programs = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if m and n and programs < MIN_PROGRAMS and m <= MAX_SPLIT_ROWS and k > segment:
        sum_segments(segment_partials(rows, weight), bias, product)
    elif m and n:
        _launch_product(rows, weight, bias, product, config, chain=False)
    return product.view(*x.shape[:-1], n)


def _launch_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, product: torch.Tensor,
                    config: TileConfig, chain: bool) -> None:
    (m, k), n = rows.shape, weight.shape[0]
    segment = k if chain else segment_length(k)
    _matmul_kernel[(triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))](
        rows, weight, bias if bias is not None else weight, product, m, n, k, rows.stride(0), weight.stride(0),
        product.stride(0), HAS_BIAS=bias is not None, CHAIN=chain, PARTIALS=False, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, **_reduction_constexprs(segment, rows.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel layer's output (linear.KERNELS["row_linear"]): this rank's segments' partials,
    gathered from every rank in rank order, added in that order; at one rank, segmented_linear (the same sums)."""
    if tp_size() == 1:
        return segmented_linear(x, weight, bias)
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
