"""Eager RMSNorm and rotary kernels for the CPU, in fewer torch ops than the reference ones.

A CPU decode step of a small model is bound by per-op dispatch, not by arithmetic: each op costs a few
microseconds whatever its size, and a layer runs dozens of them. These versions compute the same float32
products and sums in the same order as `norm.rms_norm` and `rotary.apply_rotary` (bit-identical results,
tested), in a third of the ops. Other dtypes go to the reference versions. The GPU keeps its own
(compiled) kernels: `enable()` only replaces the eager defaults.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from worker_service.layers import norm, rotary

# id(sin table) -> (the table, weakly; [max_positions, 2, head_dim // 2] holding (-sin, sin)), built once
# per table and dropped with it. Keyed by id: tensors compare elementwise, so they cannot be dict keys.
_SIGNED_SIN: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return norm.rms_norm(x, weight, eps)
    # One op: mean of squares, rsqrt, scale and weight, in the reference's order.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm(x, weight, eps), x


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        return rotary.apply_rotary(positions, q, k, cos_table, sin_table)
    signed_sin_table = _signed_sin_table(sin_table)
    cos = cos_table[positions][:, None, None, :]  # [tokens, 1 (heads), 1 (halves), head_dim // 2]
    signed_sin = signed_sin_table[positions][:, None]  # [tokens, 1, 2, head_dim // 2]
    return _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)


def _signed_sin_table(sin_table: torch.Tensor) -> torch.Tensor:
    entry = _SIGNED_SIN.get(id(sin_table))
    if entry is None or entry[0]() is not sin_table:
        entry = (weakref.ref(sin_table), torch.stack((-sin_table, sin_table), dim=1))
        _SIGNED_SIN[id(sin_table)] = entry
        weakref.finalize(sin_table, _SIGNED_SIN.pop, id(sin_table), None)
    return entry[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): x1 cos + x2 (-sin) is the same float as the
    reference's x1 cos - x2 sin (negation is exact), computed on both halves at once."""
    halves = x.unflatten(-1, (2, -1))  # [tokens, heads, 2, head_dim // 2]
    return (halves * cos + halves.flip(-2) * signed_sin).flatten(-2)


def enable() -> None:
    """Installs these kernels where the eager reference ones are in place (idempotent; a process whose
    GPU workers compiled fused kernels keeps those)."""
    if norm.KERNELS["rms_norm"] is norm.rms_norm:
        norm.KERNELS["rms_norm"] = rms_norm
    if norm.KERNELS["add_rms_norm"] is norm.add_rms_norm:
        norm.KERNELS["add_rms_norm"] = add_rms_norm
    if rotary.KERNELS["rotary"] is rotary.apply_rotary:
        rotary.KERNELS["rotary"] = apply_rotary
