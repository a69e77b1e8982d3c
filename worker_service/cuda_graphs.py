"""CUDA graphs for decode steps: captured once per batch size of a ladder up to max_num_seqs,
sharing one memory pool, replayed with the batch padded to the next captured size.

Padding rows write their K/V nowhere (slot -1) and attend to nothing (seq_len 0), so a padded
replay computes the real rows exactly as an eager step would.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.model_config import ModelConfig

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: nn.Module, config: ModelConfig, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 heads: tuple[int, int] | None = None) -> None:
        """heads: (query heads, KV heads) of this rank, when tensor parallelism splits them."""
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((self.max_batch, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((self.max_batch, config.hidden_size), dtype=next(model.parameters()).dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metadata: dict[int, AttentionMetadata] = {}
        self._prepare_metadata(heads or (config.num_heads, config.num_kv_heads), config.head_dim, backend,
                               max_model_len, block_size)

    def _prepare_metadata(self, heads: tuple[int, int], head_dim: int, backend: AttentionBackend,
                          max_model_len: int, block_size: int) -> None:
        for size in sorted(self.sizes, reverse=True):  # the largest first: smaller ones share its buffers
            metadata = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1,
                max_seq_len=max_model_len, block_size=block_size)
            self.metadata[size] = backend.prepare_decode_graph(metadata, heads[0], heads[1], head_dim,
                                                               max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        pool = None
        for size in sorted(self.sizes, reverse=True):
            metadata = self.metadata[size]
            # A warm-up run outside the graph compiles kernels and settles allocations.
            self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], metadata)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], metadata)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.graphs), self.max_batch,
                    time.perf_counter() - started)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.is_decode_only and metadata.num_seqs <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode batch (inputs already on the device), through the graph of
        the smallest captured size that holds it."""
        num_seqs = metadata.num_seqs
        size = next(s for s in self.sizes if s >= num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens, non_blocking=True)
        self.seq_lens[num_seqs:size].fill_(0)
        width = metadata.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.hidden[:num_seqs]
