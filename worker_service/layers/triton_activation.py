"""SiLU-and-mul as one Triton kernel, for GPUs. In a decode step the activation is a few MB and the
kernel's cost is its launch and tail: a 2-D grid (rows x column tiles) of contiguous, vectorised
loads and stores, with none of the index arithmetic of a generic flattened kernel.

Rounds like the eager `activation.silu_and_mul` on 16-bit inputs: silu in float32, rounded to the
input dtype, times `up` in float32, rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker_service.layers.triton_pdl import pdl_options, wait_for_previous_kernel

BLOCK_COLUMNS = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x_row, stride_out_row, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:
        wait_for_previous_kernel()
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    gate = tl.load(x_ptr + row * stride_x_row + columns, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x_row + width + columns, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + columns, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:], [..., I], in x's dtype. No host sync."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], width), dtype=x.dtype, device=x.device)
    if rows.shape[0] and width:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK_COLUMNS))](
            rows, out, width, rows.stride(0), out.stride(0), BLOCK=BLOCK_COLUMNS, num_warps=4,
            **pdl_options(x.device))
    return out.view(*x.shape[:-1], width)
