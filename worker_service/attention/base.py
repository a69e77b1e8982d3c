"""The attention backend interface: one metadata object per forward pass, K/V stored into a
paged cache, attention computed over it. Layers know nothing of scheduling."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one batch of sequences, each computing query_len new tokens (a prefill chunk or
    one decode token) on top of a context already in the paged cache.

    Tokens of all sequences are packed along dimension 0 in sequence order.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including the new tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies for backends that loop on the CPU (never read on the GPU hot path).
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes causal attention over it.

    Cache layout per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
    """

    name: str = ""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; writes them at metadata.slot_mapping."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. Token i of
        sequence s at position p attends to positions 0..p of s (causal), read from the cache."""
