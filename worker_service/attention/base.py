"""The attention backend interface: one metadata object per forward pass, K/V stored into a
paged cache, attention computed over it. Layers know nothing of scheduling."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from worker_service.layers import RMSNorm, RotaryEmbedding


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
    # Decode-only batches (max_query_len == 1) on backends with a split-K decode kernel ("triton").
    # Both optional: None lets the backend choose per call. For CUDA graph capture fix them per
    # captured batch size, so that every replay launches the same grid on the same buffers:
    # decode_num_splits from triton_decode.choose_num_splits(batch_size, num_kv_heads, max_model_len),
    # decode_workspace a float32 tensor of at least triton_decode.decode_workspace_numel(batch_size,
    # num_heads, head_dim, decode_num_splits) elements and decode_counters a zero-filled int32 one of
    # at least decode_counters_numel(batch_size, num_kv_heads, decode_num_splits), both shareable by
    # all layers and all graphs.
    decode_num_splits: int | None = None  # KV splits per sequence in the decode kernel
    decode_workspace: torch.Tensor | None = None  # float32 scratch for the splits' partial results
    decode_counters: torch.Tensor | None = None  # int32: each (sequence, KV head)'s splits done
    # [num_seqs] int32, a permutation: the order in which the decode kernel starts the sequences' programs
    # (longest_first; None: batch order). Any order gives the same results.
    decode_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """The decode kernel's program order for a batch with context lengths seq_lens: longest first, so
    that the short sequences' programs fill the device's tail instead of a long one running alone
    (int32, stable: equal lengths keep batch order)."""
    return np.argsort(-seq_lens.astype(np.int64), kind="stable").astype(np.int32)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes causal attention over it.

    Cache layout per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
    A cache in the model dtype holds K/V as they are. An fp8 cache (kv_quant.FP8_DTYPE) holds each
    token's K and V head vectors divided by their own scale, kept in k_scale and v_scale: float32
    [num_blocks, block_size, num_kv_heads], required with an fp8 cache and None otherwise (kv_quant).
    """

    name: str = ""
    # Whether a prefill's attention may be captured in a CUDA graph: it reads the batch's shape
    # only from metadata tensors, never from host lists or host syncs (max_query_len sizes the grid).
    graphs_prefill: bool = False
    # Whether a query's output is the same bits whatever else the batch holds, however its sequence's
    # prompt was chunked and whether its keys came from the prefix cache (what --deterministic needs).
    batch_invariant: bool = False

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; writes them at metadata.slot_mapping."""

    def rope_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       rotary: RotaryEmbedding, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Everything between the qkv projection and `attend`: q and k through their per-head norms
        (Qwen3; None for models without) and rotary at positions [num_tokens], then k and v into the
        cache via store_kv. q [num_tokens, num_heads, head_dim] and k, v [num_tokens, num_kv_heads,
        head_dim] may be strided views of the projection output. Returns the rotated q.

        This default composes the layers' own kernels; a backend may fuse it into one kernel as
        long as the result is the same.
        """
        if q_norm is not None:
            q = q_norm(q)
        if k_norm is not None:
            k = k_norm(k)
        q, k = rotary(positions, q, k)
        self.store_kv(k, v, k_cache, v_cache, metadata, k_scale, v_scale)
        return q

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. Token i of
        sequence s at position p attends to positions 0..p of s (causal), read from the cache."""

    def prepare_decode_graph(self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
                             max_seq_len: int) -> AttentionMetadata:
        """Fixes whatever a decode batch of metadata.num_seqs sequences needs so that one CUDA
        graph captured with it stays right for any context up to max_seq_len. Called before
        capture (it may allocate); the default needs nothing."""
        return metadata
