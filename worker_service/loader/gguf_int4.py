"""GGUF 4-bit block weights (Q4_0, Q4_1: 32 elements per block) as group-wise int4 codes, scales and zeros.

torch's weight-only int4 CPU matmul dequantizes w = (q - 8) * scale + zero per group of 32 inputs, so
Q4_1 (w = d * q + m) maps onto it with scale = d and zero = m + 8 d, and Q4_0 (w = d * (q - 8)) with
zero = 0: the codes carry over unchanged, only the two per-block constants are rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.formats.gguf_file import GGMLType, GGUFFile
from worker_service.loader.gguf_loader import unpermute_rotary_rows

GROUP_SIZE = 32
INT4_TYPES = frozenset([GGMLType.Q4_0, GGMLType.Q4_1])


@dataclass(frozen=True)
class Int4Groups:
    """A [rows, cols] weight as codes q (uint8 in 0..15, [rows, cols]) with per-group float32 scale and zero
    ([rows, cols // GROUP_SIZE]): w[r, c] = (q[r, c] - 8) * scale[r, c // 32] + zero[r, c // 32]."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The float32 weight (for checks; the matmul kernel never materialises it)."""
        q = self.codes.reshape(*self.scales.shape, GROUP_SIZE).astype(np.float32) - 8.0
        return (q * self.scales[..., None] + self.zeros[..., None]).reshape(self.codes.shape)

    @staticmethod
    def concat_rows(parts: list[Int4Groups]) -> Int4Groups:
        """Fused projections (q/k/v, gate/up) stacked along the output rows, in the order given."""
        return Int4Groups(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))


def read_int4_groups(gguf: GGUFFile, name: str, num_heads_to_unpermute: int = 0) -> Int4Groups | None:
    """The tensor's int4 form in HF row order, or None when it is not a Q4_0/Q4_1 matrix.

    num_heads_to_unpermute: llama q/k projections only (the head count), whose rows llama.cpp's converter
    interleaved; the same row permutation as the float32 loader's is applied to codes, scales and zeros.
    """
    info = gguf.tensors[name]
    if info.ggml_type not in INT4_TYPES or len(info.ggml_shape) != 2:
        return None
    cols, rows = info.ggml_shape
    type_size = 20 if info.ggml_type == GGMLType.Q4_1 else 18
    blocks = gguf.raw(name).reshape(rows, cols // GROUP_SIZE, type_size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., type_size - 16 :]
    # element j < 16 of a block is the low nibble of byte j, element 16 + j its high nibble (ggml's order)
    codes = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).reshape(rows, cols)
    if info.ggml_type == GGMLType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + np.float32(8.0) * d  # exact: both are float16 values, 8 d is a power-of-two multiple
    else:
        zeros = np.zeros_like(d)
    groups = Int4Groups(codes, d, zeros)
    if num_heads_to_unpermute:
        groups = Int4Groups(*(unpermute_rotary_rows(getattr(groups, f), num_heads_to_unpermute)
                              for f in ("codes", "scales", "zeros")))
    return groups
