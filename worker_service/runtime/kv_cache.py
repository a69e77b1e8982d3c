"""One rank's paged KV cache: its geometry, how many blocks fit (on a GPU, measured by a warm-up step of
the largest size served: max_num_batched_tokens of prefill, logits and sampling for max_num_seqs rows
through the sampler's most memory-hungry path, over a cache just large enough), its allocation, and
the views the attention layers read."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from common.contract.config import WorkerConfig
from common.contract.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from worker_service.attention.kv_quant import SCALE_DTYPE, allocate_scales, is_fp8
from worker_service.parallel.distributed import min_over_ranks
from worker_service.runtime.batch import ScheduledChunk
from worker_service.runtime.sequence_state import WorkerSequence

logger = logging.getLogger(__name__)

# Filtering by sort, top log-probabilities: the sampler's largest [rows, vocab] intermediates; and
# prompt logprobs, whose blocks of [rows, vocab] logits the peak must count too.
HEAVIEST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=True,
                                   num_top_logprobs=MAX_TOP_LOGPROBS, num_prompt_logprobs=MAX_TOP_LOGPROBS)
# Temperature alone: the fused sampling kernel on CUDA.
PLAIN_SAMPLING = SamplingParams(temperature=1.0)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V, plus with an fp8 cache one float32 scale per head vector (kv_quant)."""
        vector_bytes = self.head_dim * self.dtype.itemsize + (SCALE_DTYPE.itemsize if is_fp8(self.dtype) else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * vector_bytes

    def allocate(self, num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cache [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] and, when
        it is fp8, its scales."""
        # Zeros: every slot is written before it is read, but kernels that load whole pages (flash-attn's
        # TMA tiles) read a partly used page's rows past its sequence, and 0 * NaN would be NaN.
        kv_cache = torch.zeros((self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim),
                               dtype=self.dtype, device=device)
        kv_scales = None
        if is_fp8(self.dtype):
            kv_scales = allocate_scales(torch.zeros, (self.num_layers, 2, num_blocks), self.block_size,
                                        self.num_kv_heads, device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block / 2**20)
        return kv_cache, kv_scales


def attach_kv_cache(layers: list[nn.Module], kv_cache: torch.Tensor | None, kv_scales: torch.Tensor | None) -> None:
    """Points each attention layer at its slice of the cache (at nothing when there is none)."""
    for layer_index, attention in enumerate(layers):
        caches = kv_cache[layer_index] if kv_cache is not None else (torch.empty(0), torch.empty(0))
        attention.k_cache, attention.v_cache = caches[0], caches[1]
        scales = kv_scales[layer_index] if kv_scales is not None else (None, None)
        attention.k_scale, attention.v_scale = scales[0], scales[1]


def num_fitting_blocks(config: WorkerConfig, spec: KVCacheSpec, device: torch.device,
                       warmup_peak_memory: Callable[[], int]) -> int:
    """Blocks that fit in the memory budget (or the configured override). Under tensor parallelism
    every rank calls this once, together: the group takes its smallest rank's."""
    if config.num_kv_blocks:
        blocks = config.num_kv_blocks
    elif device.type == "cuda":
        blocks = _gpu_kv_budget(config.gpu_memory_utilization, device, warmup_peak_memory) // spec.bytes_per_block
    else:
        blocks = config.cpu_kv_cache_bytes // spec.bytes_per_block
    return min_over_ranks(blocks, device)


def _gpu_kv_budget(utilization: float, device: torch.device, warmup_peak_memory: Callable[[], int]) -> int:
    """utilization of the device, less what other processes hold and the peak of the warm-up step
    (warmup_peak_memory runs it)."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    peak = warmup_peak_memory()
    # CUDA graphs and the allocator's fragmentation take a little more than the warm-up shows.
    margin = 512 * 2**20
    budget = int(total * utilization) - used_by_others - peak - margin
    logger.info("GPU memory: %.1f GiB total, %.1f GiB used by others, %.2f GiB peak of a warm-up step; "
                "%.1f GiB for the KV cache", total / 2**30, used_by_others / 2**30, peak / 2**30, budget / 2**30)
    return budget


def warmup_steps(config: WorkerConfig) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    """The warm-up step, and a small one of plain temperature sampling (on CUDA the fused kernel:
    compiled then, so that no request waits for that)."""
    largest = _warmup_chunks(config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                             HEAVIEST_SAMPLING)
    num_blocks = sum(len(c.state.block_table) for c in largest)
    return largest, _warmup_chunks(2, min(2, num_blocks), config.block_size, PLAIN_SAMPLING)


def _warmup_chunks(num_tokens: int, num_seqs: int, block_size: int, sampling: SamplingParams) -> list[ScheduledChunk]:
    """num_seqs prompts sharing num_tokens, each on its own consecutive blocks."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    chunks, next_block = [], 0
    for seq_id, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        state = WorkerSequence(seq_id=seq_id, block_table=list(range(next_block, next_block + num_blocks)),
                               num_computed_tokens=0, num_tokens=length, num_prompt_tokens=length,
                               sampling=sampling)
        next_block += num_blocks
        chunks.append(ScheduledChunk(state, [seq_id % 100] * length, samples=True))
    return chunks
