"""Gated activation of the MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: silu(first half) * second half, matching the gate_up_proj layout
    (gate rows first, then up rows)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# The implementation the MLP calls (through linear.silu_and_mul_linear); fused_kernels.enable() swaps in
# a Triton one on GPUs.
KERNELS = {"silu_and_mul": silu_and_mul}
