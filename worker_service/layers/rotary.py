"""Rotary position embedding (the "rotate half" layout of HF Llama/Qwen) with HF's rope scaling kinds.

cos/sin are precomputed in float32 for every position the model can see, so a forward pass only
gathers rows by position: no per-step recomputation and nothing that breaks CUDA graph capture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling as HF's rope_scaling: kind is "default", "linear", "dynamic" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling, max_position: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by factor, short ones kept, the band between smoothed."""
    original_len = scaling.original_max_position_embeddings or max_position
    low_freq_wavelen = original_len / scaling.low_freq_factor
    high_freq_wavelen = original_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_ntk_freqs(
    head_dim: int, base: float, factor: float, max_position: int, num_positions: int
) -> torch.Tensor:
    """Angles [num_positions - max_position, head_dim // 2] for the positions past max_position.

    HF's dynamic NTK rescales the base from the longest sequence of the current forward call
    (seq_len = max(position) + 1) and rotates every token of that call with it. Here each position p
    uses the base for seq_len = p + 1: identical to HF for token-by-token decode past the original
    length (HF recomputes the base at each such step, and cached keys keep the rotation they were
    written with) and for any prompt within it; a single prefill crossing max_position is rotated
    per position instead of with one base for the whole prompt.
    """
    seq_lens = torch.arange(max_position + 1, num_positions + 1, dtype=torch.float32)
    # Same operation order and float32 math as HF, which passes seq_len as a tensor.
    scaled_base = base * ((factor * seq_lens / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (scaled_base[:, None] ** exponents[None, :])
    return (seq_lens - 1)[:, None] * inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position. Kinds: "default", "linear", "dynamic" (NTK), "llama3".

    max_positions is max_position_embeddings, times factor for "dynamic" (whose HF config keeps the
    original length there). The cos/sin buffers stay float32: build the model in its dtype rather
    than calling `model.to(dtype)`, which would round them.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        scaling = scaling or RopeScaling()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.kind = scaling.kind
        inv_freq = _default_inv_freq(head_dim, base)
        self.max_positions = max_position
        if scaling.kind == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling.kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position)
        elif scaling.kind == "dynamic":
            self.max_positions = int(max_position * max(scaling.factor, 1.0))
        elif scaling.kind != "default":
            raise ValueError(f"rope scaling kind {scaling.kind!r} is not supported")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        if self.max_positions > max_position:
            extra = _dynamic_ntk_freqs(head_dim, base, scaling.factor, max_position, self.max_positions)
            freqs = torch.cat([freqs, extra], dim=0)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_positions, head_dim // 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim]."""
        return KERNELS["rotary"](positions, q, k, self.cos, self.sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, kind={self.kind}"


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(-2)
    sin = sin_table[positions].unsqueeze(-2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


# The implementation the layer calls; fused_kernels.enable() swaps in a compiled one on GPUs.
KERNELS = {"rotary": apply_rotary}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In float32 whatever x's dtype (HF multiplies in x's dtype; this is at least as accurate).
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
