"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

from typing import overload

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_float = x.float()
    variance = x_float.pow(2).mean(-1, keepdim=True)
    # Round back to the input dtype before the weight multiply, the order HF uses.
    return weight * (x_float * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The add happens in the activation dtype, like HF's `residual + hidden_states`.
    x = x + residual
    return rms_norm(x, weight, eps), x


# The implementations the layers call; fused_kernels.enable() swaps in compiled ones on GPUs.
KERNELS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm}


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 as Hugging Face does.

    `forward(x)` returns the normalised x. `forward(x, residual)` first adds residual to x and
    returns (normalised sum, sum): the sum is the residual stream the next layer adds back.
    Works on any leading shape, so it also serves as Qwen3's per-head q/k norm on [n, heads, head_dim].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return KERNELS["rms_norm"](x, self.weight, self.eps)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        return KERNELS["add_rms_norm"](x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
