"""The Triton attention backend, the default on CUDA: one kernel for the q/k norms, rotary and the
K/V store, a split-K paged decode kernel for decode-only batches, and a paged flash-attention
kernel for everything else."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker_service.attention import register_backend
from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.attention.triton_decode import (
    choose_num_splits,
    decode_counters_numel,
    decode_workspace_numel,
    paged_decode,
)
from worker_service.attention.triton_prefill import paged_prefill
from worker_service.attention.triton_rope_store import rope_and_store
from worker_service.attention.triton_store_kv import store_kv

if TYPE_CHECKING:
    from worker_service.layers import RMSNorm, RotaryEmbedding


@register_backend("triton")
class TritonAttentionBackend(AttentionBackend):
    """No host syncs and no data-dependent host logic on the decode path, so it can be captured in a
    CUDA graph (see AttentionMetadata.decode_num_splits, decode_workspace, decode_counters); neither
    on the prefill path, whose grid max_query_len sizes."""

    graphs_prefill = True

    def __init__(self) -> None:
        # Split-decode scratch (float32 partials, int32 counters) allocated here when the metadata
        # brings none. Buffers are only ever added, never freed: a CUDA graph captured with one keeps
        # using its address on replay.
        self._buffers: list[torch.Tensor] = []

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 metadata: AttentionMetadata, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)

    def rope_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       rotary: RotaryEmbedding, q_norm: RMSNorm | None, k_norm: RMSNorm | None,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One fused kernel instead of the default's five (see triton_rope_store)."""
        norms = [norm for norm in (q_norm, k_norm) if norm is not None]
        if len({norm.eps for norm in norms}) > 1:
            raise ValueError(f"the fused kernel takes one eps for both norms, got {[norm.eps for norm in norms]}")
        return rope_and_store(q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, metadata.slot_mapping,
                              q_norm_weight=q_norm.weight if q_norm is not None else None,
                              k_norm_weight=k_norm.weight if k_norm is not None else None,
                              eps=norms[0].eps if norms else 0.0, k_scale=k_scale, v_scale=v_scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if not metadata.is_decode_only:
            return paged_prefill(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                 metadata.query_start_loc, metadata.max_query_len, scale, k_scale=k_scale,
                                 v_scale=v_scale)
        num_seqs, num_heads, head_dim = q.shape
        if num_seqs != metadata.num_seqs:
            raise ValueError(f"decode batch: {num_seqs} query tokens for {metadata.num_seqs} sequences")
        num_splits = metadata.decode_num_splits
        if num_splits is None:
            num_splits = choose_num_splits(num_seqs, k_cache.shape[2], metadata.max_seq_len, q.device)
        workspace, counters = metadata.decode_workspace, metadata.decode_counters
        if workspace is None or counters is None:
            workspace, counters = self._scratch(num_seqs, num_heads, k_cache.shape[2], head_dim, num_splits, q.device)
        return paged_decode(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, num_splits,
                            workspace, counters=counters, k_scale=k_scale, v_scale=v_scale,
                            order=metadata.decode_order)

    def prepare_decode_graph(self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
                             max_seq_len: int) -> AttentionMetadata:
        device = metadata.seq_lens.device
        num_splits = choose_num_splits(metadata.num_seqs, num_kv_heads, max_seq_len, device)
        metadata.decode_num_splits = num_splits
        metadata.decode_workspace, metadata.decode_counters = self._scratch(
            metadata.num_seqs, num_heads, num_kv_heads, head_dim, num_splits, device)
        return metadata

    def _scratch(self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int,
                 device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The split decode's workspace and counters (None, None with one split)."""
        return (self._buffer(decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits), torch.float32, device),
                self._buffer(decode_counters_numel(num_seqs, num_kv_heads, num_splits), torch.int32, device))

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A cached, zero-filled buffer of at least numel elements (None when numel is 0). Shared: every
        launch writes its partials before it reads them, and leaves its counters at zero."""
        if numel == 0:
            return None
        for buffer in self._buffers:
            if buffer.device == device and buffer.dtype == dtype and buffer.numel() >= numel:
                return buffer
        # Round up so that a handful of buffers covers every batch size.
        buffer = torch.zeros(1 << (numel - 1).bit_length(), dtype=dtype, device=device)
        self._buffers.append(buffer)
        return buffer
