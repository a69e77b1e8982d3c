"""The batch-invariant Triton attention backend (`--deterministic` on GPUs): one kernel for every
batch, the paged flash-attention kernel of triton_prefill, so that a query row's output depends only
on its own q and its sequence's keys and values, never on what else the batch holds.

The default backend sends decode-only batches to a split-K kernel whose number of splits follows the
batch size, and whose reductions differ from the prefill kernel's: a token recomputed by a prefill
(after a preemption or a worker's loss, or in another chunking) would differ from the same token
decoded. Here decode rows are query tiles like any other ((token, head) rows of one KV head's group),
the context is walked in absolute tiles of 64 keys from position 0, every tile through the masked
path (`one_pass`), with no split of the context: the order of every sum is a function of the row's
position alone. Masked keys contribute exact zeros (p = 0, the running max and sum unchanged), so the
tiles past a row's own position that its query tile shares with later rows change nothing.
"""
from __future__ import annotations

import torch

from worker_service.attention import register_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.triton_backend import TritonAttentionBackend
from worker_service.attention.triton_prefill import paged_prefill


@register_backend("triton-invariant")
class TritonInvariantAttentionBackend(TritonAttentionBackend):
    """Batch-invariant: see the module docstring. Capturable in CUDA graphs like the prefill path
    (its grid from the batch's size and max_query_len, no host syncs)."""

    batch_invariant = True

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
               scale: float, k_scale: torch.Tensor | None = None,
               v_scale: torch.Tensor | None = None) -> torch.Tensor:
        return paged_prefill(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                             metadata.max_query_len, scale, k_scale=k_scale, v_scale=v_scale, one_pass=True)

    def prepare_decode_graph(self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
                             max_seq_len: int) -> AttentionMetadata:
        return metadata  # no split-K workspace: the prefill kernel needs none
