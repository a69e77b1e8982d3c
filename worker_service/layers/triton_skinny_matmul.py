"""y = x W^T (+ b) for few rows of x (decode steps), as one Triton kernel meant to read W at memory
bandwidth (measured on a GPU by bench/skinny_matmul_bench.py).

At one to sixteen rows a linear layer is a matrix-vector product: each weight element is read once
and used M times, so the time is the weight's bytes over memory bandwidth. cuBLAS stays far from
that on the small projections of a decode step (Qwen3-0.6B on an H200: 30 us per layer against a
floor of about 8; down_proj also takes a split-K reduction kernel). Here each program owns BLOCK_N
output columns (rows of W) over all of K: a small BLOCK_N gives hundreds of programs even at N = 1024,
wide BLOCK_K tiles keep many 16-byte loads in flight, and there is no split-K, so no atomics, no
workspace and one launch.

The products are summed in float32 on CUDA cores (w * x broadcast, tl.sum along K, once per row of
x), or, for more rows, with tl.dot on x padded to 16 rows (USE_DOT); the bias is added in float32
and the result is rounded once to x's dtype. The block sizes come from `_config`, a fixed function of
the shape, not from autotuning: CUDA graphs are captured after one eager warm-up, and nothing may be
benchmarked or synchronised then.

skinny_norm_linear also does the RMSNorm before the product (with its residual add) in the same
kernel: a decode step's norms were launch-bound kernels of their own (56 of ~1.7 us per token of
Qwen3-0.6B on an H200); `normed_linear` is what the model layers call through linear.KERNELS.
skinny_silu_linear likewise computes the MLP's SiLU-and-mul where the down product loads its input
(`silu_and_mul_linear`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from worker_service.layers.linear import (
    MergedColumnLinear,
    RowLinear,
    compose_normed_linear,
    compose_silu_and_mul_linear,
    reference_linear,
)
from worker_service.layers.norm import RMSNorm
from worker_service.layers.triton_pdl import pdl_options, wait_for_previous_kernel
from worker_service.parallel.distributed import tp_size

MAX_ROWS = 16  # the most rows of x the kernel takes; more go to cuBLAS, which is efficient there
DTYPES = (torch.bfloat16, torch.float16)
# Programs to aim for: about four per multiprocessor of an H100/H200 (132), enough that each one's
# loads overlap the others' and that the last wave is short.
TARGET_PROGRAMS = 512
# Weight elements one program loads per step of K: 8192 bf16 (16 KB) is eight 16-byte loads per thread
# at 4 warps, a few such programs per multiprocessor keep the ~3 MB in flight that the H200's memory
# needs to reach its bandwidth (roughly bandwidth x latency: 4.8 TB/s x ~0.7 us).
TILE_ELEMENTS = 8192
MAX_BLOCK_K = 4096


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool


@triton.jit
def _load_rows(x_ptr, residual_ptr, rows, ks, mask, stride_x_row, stride_residual_row, K,
               ADD_RESIDUAL: tl.constexpr, GATED: tl.constexpr):
    """x at (rows, ks), or x + residual rounded to x's dtype (as the eager norm.add_rms_norm adds), or,
    GATED, silu(gate) * up of x's rows [gate | up] (K columns each), rounded as the Triton
    silu_and_mul rounds (triton_activation)."""
    x = tl.load(x_ptr + rows * stride_x_row + ks, mask=mask, other=0.0)
    if GATED:
        up = tl.load(x_ptr + rows * stride_x_row + K + ks, mask=mask, other=0.0)
        gate = x.to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32)
        x = (activated * up.to(tl.float32)).to(x.dtype)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + rows * stride_residual_row + ks, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _load_weight_tile(w_ptr, w_rows, offsets, k, K, stride_w_row, EVEN_K: tl.constexpr):
    """W[w_rows, k:k + BLOCK_K], zeros past K."""
    w_ptrs = w_ptr + w_rows[:, None] * stride_w_row + (k + offsets)[None, :]
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=(k + offsets)[None, :] < K, other=0.0)


@triton.jit
def _normalize(x, rstd, norm_w_ptr, ks, mask):
    """x times rstd (each row's 1 / rms) and the norm's weight, rounded as the eager norm rounds."""
    normed = (x.to(tl.float32) * rstd).to(x.dtype)
    norm_w = tl.load(norm_w_ptr + ks, mask=mask, other=0.0)
    return (norm_w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, sum_ptr, eps, M, N, K,
                          stride_x_row, stride_w_row, stride_out_row, stride_residual_row, stride_sum_row,
                          HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
                          ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    # NORM: 0 the product of x, 1 of rms_norm(x), 2 of rms_norm(x + residual) (x + residual -> sum_ptr).
    # GATED (with NORM 0): the product of silu_and_mul(x), x's rows [gate | up] of 2 * K columns.
    columns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    # The last program's rows past N re-read row N - 1 (unmasked loads); their results are not stored.
    w_rows = tl.minimum(columns, N - 1).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)  # rows of x
    offsets = tl.arange(0, BLOCK_K)
    first = tl.program_id(0) == 0
    if ONE_PASS:
        # The weight tile (all of K) is issued before the wait: no kernel writes weights, so under PDL
        # its read overlaps the previous kernel's tail (a decode step's products start loaded).
        w_tile = _load_weight_tile(w_ptr, w_rows, offsets, 0, K, stride_w_row, EVEN_K)
    if PDL:
        wait_for_previous_kernel()
    # With a norm every program normalises the rows itself (a few KB from L2), and the first one
    # writes x + residual, the residual stream the next layer adds back. ONE_PASS (the CUDA-core path
    # with all of K in one tile: Qwen3-0.6B's and -8B's norms) takes each row's rms from the tile it
    # multiplies, after issuing the weight's loads; otherwise a first pass over the rows takes it.
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM != 0 and not ONE_PASS:
        for k in range(0, K, BLOCK_K):
            mask = (rows[:, None] < M) & ((k + offsets)[None, :] < K)
            x = _load_rows(x_ptr, residual_ptr, rows[:, None], (k + offsets)[None, :], mask, stride_x_row,
                           stride_residual_row, K, NORM == 2, False)
            if NORM == 2:
                tl.store(sum_ptr + rows[:, None] * stride_sum_row + (k + offsets)[None, :], x, mask=mask & first)
            rstd += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        rstd = tl.math.rsqrt(rstd / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # acc[n, m] = y[m, n]
    for k in range(0, K, BLOCK_K):
        if ONE_PASS:
            w = w_tile
        else:
            w = _load_weight_tile(w_ptr, w_rows, offsets, k, K, stride_w_row, EVEN_K)
        if USE_DOT:
            ks = (k + offsets)[None, :]
            x_mask = (rows[:, None] < M) & (ks < K)
            x = _load_rows(x_ptr, residual_ptr, rows[:, None], ks, x_mask, stride_x_row, stride_residual_row, K,
                           NORM == 2, GATED)
            if NORM != 0:
                x = _normalize(x, rstd[:, None], norm_w_ptr, ks, x_mask)
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            w = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x_mask = (m < M) & (k + offsets < K)
                x = _load_rows(x_ptr, residual_ptr, m, k + offsets, x_mask, stride_x_row, stride_residual_row, K,
                               NORM == 2, GATED)
                if NORM != 0:
                    if ONE_PASS:
                        if NORM == 2:
                            tl.store(sum_ptr + m * stride_sum_row + k + offsets, x, mask=x_mask & first)
                        row_rstd = tl.math.rsqrt(tl.sum(x.to(tl.float32) * x.to(tl.float32)) / K + eps)
                    else:
                        row_rstd = tl.sum(tl.where(rows == m, rstd, 0.0))
                    x = _normalize(x, row_rstd, norm_w_ptr, k + offsets, x_mask)
                partial = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
                acc = tl.where(rows[None, :] == m, acc + partial[:, None], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[None, :] * stride_out_row + columns[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(columns[:, None] < N) & (rows[None, :] < M))


def _config(m: int, n: int, k: int) -> SkinnyConfig:
    """Block sizes for y [m, n] = x [m, k] W^T, chosen from the shape alone (no autotuning), after
    `bench/skinny_matmul_bench.py --sweep` on an H200 (bench/results/2026-11-30-h200-skinny-matmul.txt).

    One or two rows: CUDA cores. BLOCK_K is all of K up to MAX_BLOCK_K (a power of two, masked past K),
    so that a program issues its loads at once; BLOCK_N is TILE_ELEMENTS / BLOCK_K rows, halved while
    that leaves fewer than TARGET_PROGRAMS programs (N = 1024 at K = 2048: 2 rows, 512 programs).
    Within 10 % of the sweep's best at one row, 1.1-3.9x cuBLAS (whose 1024 x 2048 kernel reads 330 GB/s).
    From three rows the CUDA cores' multiply-adds (m per weight element) cost more than the reads
    (four rows took twice cuBLAS's time): tl.dot on tensor cores, x padded to 16 rows, with the sweep's
    best tiles: 64 x 128 pipelined 5 deep for wide outputs, 16 x 512 for N = 1024 (within 2 % of the
    best found; 0.6-0.98x of cuBLAS's time at 4 to 16 rows).
    """
    if m > 2:
        return SkinnyConfig(64, 128, 4, 5, True) if n >= 4096 else SkinnyConfig(16, 512, 4, 3, True)
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    block_n = max(1, TILE_ELEMENTS // block_k)
    while block_n > 1 and triton.cdiv(n, block_n) < TARGET_PROGRAMS:
        block_n //= 2
    return SkinnyConfig(block_n, block_k, 4, 1, False)


def _tile_constexprs(config: SkinnyConfig, m: int, k: int) -> dict[str, int | bool]:
    """The kernel's tiling constants for x [m, k] under config (the launch and the compile test share them)."""
    return dict(BLOCK_M=16 if config.use_dot else triton.next_power_of_2(m), BLOCK_N=config.block_n,
                BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0, USE_DOT=config.use_dot,
                ONE_PASS=not config.use_dot and k <= config.block_k)


def use_skinny(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether skinny_linear takes F.linear(x, weight): 16-bit CUDA tensors, a contiguous 2-D weight, at
    most MAX_ROWS rows of x, and rows of K a multiple of 8 elements (16 bytes, one vectorised load).
    gated: x holds [gate | up] rows of 2 * K (skinny_silu_linear)."""
    if not (x.is_cuda and weight.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or x.dim() == 0:
        return False
    k = weight.shape[1]
    width = 2 * k if gated else k
    return x.shape[-1] == width and k % 8 == 0 and k > 0 and 1 <= x.numel() // width <= MAX_ROWS


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most MAX_ROWS rows (see use_skinny), W [N, K],
    written into `out` if given (contiguous [..., N]). float32 sums, one rounding to x's dtype; no
    host sync. `config` overrides _config (benchmarks)."""
    return _launch(x, weight, bias, config, out=out)[0]


def skinny_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None) -> torch.Tensor:
    """F.linear(silu_and_mul(gate_up), weight, bias) for gate_up [..., 2 * K] ([gate | up], at most
    MAX_ROWS rows: use_skinny with gated), in one kernel: the activation is computed where the product
    loads it (a decode step of Qwen3-0.6B launched 28 activation kernels). Rounds as
    triton_activation.silu_and_mul then skinny_linear do."""
    return _launch(gate_up, weight, bias, config, gated=True)[0]


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(s), weight, bias), s) with s = x + residual (x when residual is None), in one
    kernel: no launch and no round trip through memory for the norm (in a decode step of Qwen3-0.6B,
    56 launches of ~1.7 us each). Rounds as norm.add_rms_norm then skinny_linear do."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    return _launch(x, weight, bias, config, (residual, norm_weight, eps))


def _rows(tensor: torch.Tensor, k: int) -> torch.Tensor:
    rows = tensor.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig | None,
            norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
            out: torch.Tensor | None = None, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on x's rows; norm: (residual or None, norm weight, eps); gated: x's rows are [gate | up]
    and the product is silu_and_mul's (no norm then). Returns the product (in `out` if given) and the
    norm's input sum (x itself without a residual, or without a norm)."""
    n, k = weight.shape
    if weight.stride(-1) != 1:
        raise ValueError("skinny_linear needs the weight's rows contiguous")
    if gated and norm is not None:
        raise ValueError("skinny_linear: a norm before a gated activation")
    rows = _rows(x, 2 * k if gated else k)
    m = rows.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype}, expected contiguous {(*x.shape[:-1], n)} {x.dtype}")
    product = out.view(m, n)
    residual, norm_weight, eps = norm if norm is not None else (None, None, 0.0)
    residual_rows = _rows(residual, k) if residual is not None else None
    # x + residual, written by the kernel; without a residual the norm's input is x itself.
    total = torch.empty_like(rows) if residual_rows is not None else None
    if m and n:
        bias = bias.contiguous() if bias is not None else None
        config = config or _config(m, n, k)
        spare = weight  # any pointer for the operands this launch does not read
        _skinny_matmul_kernel[(triton.cdiv(n, config.block_n),)](
            rows, weight, bias if bias is not None else spare, product,
            residual_rows if residual_rows is not None else spare,
            norm_weight if norm_weight is not None else spare, total if total is not None else spare, eps,
            m, n, k,
            rows.stride(0), weight.stride(0), product.stride(0),
            residual_rows.stride(0) if residual_rows is not None else 0,
            total.stride(0) if total is not None else 0,
            HAS_BIAS=bias is not None, NORM=0 if norm is None else 1 if residual is None else 2, GATED=gated,
            **_tile_constexprs(config, m, k), num_warps=config.num_warps, num_stages=config.num_stages,
            **pdl_options(x.device))
    return product.view(*x.shape[:-1], n), total.view(x.shape) if total is not None else x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """reference_linear, through skinny_linear where use_skinny holds (linear.KERNELS["linear"] on GPUs)."""
    if use_skinny(x, weight):
        return skinny_linear(x, weight, bias, out=out)
    return reference_linear(x, weight, bias, out)


def silu_and_mul_linear(gate_up: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """linear.silu_and_mul_linear, in one kernel (skinny_silu_linear) where use_skinny holds and the
    layer's product is one rank's whole sum (a RowLinear without tensor parallelism); else as linear's."""
    if isinstance(layer, RowLinear) and tp_size() == 1 and use_skinny(gate_up, layer.weight, gated=True):
        return skinny_silu_linear(gate_up, layer.weight, layer.bias)
    return compose_silu_and_mul_linear(gate_up, layer)


def normed_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                  layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """linear.normed_linear, in one kernel (skinny_norm_linear) where use_skinny holds and the layer
    is column-parallel (a plain product: no collective, no quantized weight); else as linear's."""
    if (isinstance(layer, MergedColumnLinear) and use_skinny(x, layer.weight) and norm.weight.dtype == x.dtype
            and norm.weight.is_contiguous()):
        return skinny_norm_linear(x, residual, norm.weight, norm.eps, layer.weight, layer.bias)
    return compose_normed_linear(x, residual, norm, layer)
