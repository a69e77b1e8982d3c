"""Gated activation of the MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * I] -> [..., I]: silu(first half) * second half, matching the gate_up_proj layout
    (gate rows first, then up rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KERNELS["silu_and_mul"](x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# The implementation the layer calls; fused_kernels.enable() swaps in a compiled one on GPUs.
KERNELS = {"silu_and_mul": silu_and_mul}
