"""CUDA graphs: one launch for a whole forward pass instead of ~20 kernel launches per layer.

Two ladders of graphs, each captured once per size (largest first, sharing one memory pool) and
replayed with the batch padded to the next captured size:
- decode steps, per batch size up to max_num_seqs;
- the prefill of one sequence (a lone request's first token, where the host's launches, not the
  GPU, set the time: 3 ms of GPU work behind ~15 ms of launches at 512 tokens), per token count up
  to PREFILL_GRAPH_MAX_TOKENS; the context before the chunk may be anything (a cached prefix, an
  earlier chunk). Beyond that size a prefill is bound by the GPU, and launches do not matter.

Padding tokens write their K/V nowhere (slot -1) and are no query of the attention (decode rows
with seq_len 0, prefill rows past the sequence's query length): every other layer works row by
row, so a padded replay computes the real rows exactly as an eager step of the padded size would.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.models.config import ModelConfig

logger = logging.getLogger(__name__)

PREFILL_GRAPH_MAX_TOKENS = 2048


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (always included)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Prefill token counts: 16, 32, ... 256, then every 256 (padding at most a quarter of the
    work above 256 tokens), up to min(max_tokens, PREFILL_GRAPH_MAX_TOKENS), always included."""
    limit = min(max_tokens, PREFILL_GRAPH_MAX_TOKENS)
    sizes = [size for size in (16, 32, 64, 128) if size < limit]
    sizes += list(range(256, limit, 256))
    return sorted(set(sizes) | {limit})


class _GraphLadder:
    """Static input and output buffers, and one graph per size reading and writing them."""

    def __init__(self, model: nn.Module, config: ModelConfig, sizes: list[int], max_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.sizes = sizes
        max_tokens, max_blocks = sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        self.hidden = torch.zeros((max_tokens, config.hidden_size), dtype=next(model.parameters()).dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.metadata: dict[int, AttentionMetadata] = {}  # per size, filled by the subclass

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> tuple[int, int] | None:
        """Captures every size into pool (a new one when None); returns the pool, for the next
        ladder to share (only one graph ever runs at a time, and each copies its output out)."""
        started = time.perf_counter()
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
        logger.info("captured %d %s CUDA graphs (%d..%d) in %.1f s", len(self.graphs), type(self).__name__,
                    self.sizes[0], self.sizes[-1], time.perf_counter() - started)
        return pool

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                size: int) -> torch.Tensor:
        """Copies the step's tokens and their slots in (padding slots -1) and replays size's graph."""
        num_tokens = input_ids.shape[0]
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[num_tokens:size].fill_(-1)
        num_seqs, width = metadata.block_tables.shape
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.hidden[:num_tokens]


class DecodeGraphs(_GraphLadder):
    def __init__(self, model: nn.Module, config: ModelConfig, backend: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 heads: tuple[int, int] | None = None) -> None:
        """heads: (query heads, KV heads) of this rank, when tensor parallelism splits them."""
        sizes = capture_sizes(max_num_seqs)
        super().__init__(model, config, sizes, sizes[-1], max_model_len, block_size, device)
        self.max_batch = sizes[-1]
        query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        # The decode kernel's program order: the step's own, padding rows (seq_len 0) last.
        self.batch_order = torch.arange(self.max_batch, dtype=torch.int32, device=device)
        self.decode_order = self.batch_order.clone()
        num_heads, num_kv_heads = heads or (config.num_heads, config.num_kv_heads)
        for size in sorted(sizes, reverse=True):  # the largest first: smaller ones share its buffers
            metadata = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size], query_start_loc=query_start_loc[:size + 1],
                seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1,
                max_seq_len=max_model_len, block_size=block_size, decode_order=self.decode_order[:size])
            self.metadata[size] = backend.prepare_decode_graph(metadata, num_heads, num_kv_heads, config.head_dim,
                                                               max_model_len)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.is_decode_only and metadata.num_seqs <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode batch (inputs already on the device), through the graph of
        the smallest captured size that holds it."""
        num_seqs = metadata.num_seqs
        size = next(s for s in self.sizes if s >= num_seqs)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens, non_blocking=True)
        self.seq_lens[num_seqs:size].fill_(0)
        order = self.batch_order if metadata.decode_order is None else metadata.decode_order
        self.decode_order[:num_seqs].copy_(order[:num_seqs], non_blocking=True)
        self.decode_order[num_seqs:size].copy_(self.batch_order[num_seqs:size], non_blocking=True)
        return self._replay(input_ids, positions, metadata, size)


class PrefillGraphs(_GraphLadder):
    def __init__(self, model: nn.Module, config: ModelConfig, max_tokens: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        """max_tokens: the most tokens a step may hold."""
        super().__init__(model, config, prefill_capture_sizes(max_tokens), 1, max_model_len, block_size, device)
        # [0, query_len]: query_len 0 while capturing (every attention program returns at once).
        self.query_start_loc = torch.zeros(2, dtype=torch.int32, device=device)
        for size in self.sizes:
            # max_query_len sizes the attention's grid: programs past the real query length return.
            self.metadata[size] = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc,
                seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=size,
                max_seq_len=max_model_len, block_size=block_size)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (metadata.num_seqs == 1 and not metadata.is_decode_only
                and metadata.slot_mapping.shape[0] <= self.sizes[-1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of one sequence's prefill chunk (inputs already on the device)."""
        size = next(s for s in self.sizes if s >= input_ids.shape[0])
        self.query_start_loc.copy_(metadata.query_start_loc, non_blocking=True)
        self.seq_lens.copy_(metadata.seq_lens, non_blocking=True)
        return self._replay(input_ids, positions, metadata, size)
