"""SiLU-and-mul on the CPU whose result for an element never depends on where it sits in the tensor.

torch's vectorised silu (and sigmoid) compute the last elements of each contiguous stretch, the tail
that does not fill a vector, with a scalar formula: measured, it differs from the vector one in the last
bit for about 4 % of inputs. Where a stretch ends depends on the tensor's size and on how the elements
are split over threads, so a row's values moved with the batch. torch.exp goes through MKL's VML,
which gave the same bits for an element wherever it sat (0 differences over 2^20 inputs in pieces of
random sizes), and the other operations here are correctly rounded IEEE operations: so silu is
written as x / (1 + exp(-x)).
"""
from __future__ import annotations

import torch


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: silu(first half) * second half (activation.silu_and_mul's layout)."""
    gate, up = x.chunk(2, dim=-1)
    denominator = torch.neg(gate).exp_().add_(1)  # in place from here on: fewer allocations a decode step
    return torch.div(gate, denominator, out=denominator).mul_(up)
