"""Measures the GPU memory a worker needs besides its KV cache: a warm-up step of the largest size
it serves (max_num_batched_tokens of prefill, logits and sampling for max_num_seqs rows), run over a
temporary cache just large enough for it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.batch import ScheduledChunk, build_model_input
from worker_service.sequence_state import WorkerSequence

if TYPE_CHECKING:
    from worker_service.model_runner import ModelRunner


def warmup_chunks(num_tokens: int, num_seqs: int, block_size: int) -> list[ScheduledChunk]:
    """num_seqs prompts sharing num_tokens, each on its own consecutive blocks."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
    chunks, next_block = [], 0
    for seq_id, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        state = WorkerSequence(seq_id=seq_id, block_table=list(range(next_block, next_block + num_blocks)),
                               num_computed_tokens=0, num_tokens=length, num_prompt_tokens=length,
                               sampling=worker_pb2.SamplingParams(temperature=1.0))
        next_block += num_blocks
        chunks.append(ScheduledChunk(state, [seq_id % 100] * length, samples=True))
    return chunks


def profile_peak_memory(runner: ModelRunner) -> int:
    """Peak bytes allocated by torch during the warm-up step, without the temporary cache."""
    config = runner.config
    chunks = warmup_chunks(config.max_num_batched_tokens, config.max_num_seqs, config.block_size)
    num_blocks = sum(len(c.state.block_table) for c in chunks)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    runner.init_cache(num_blocks, capture_graphs=False)
    cache_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    runner.run(build_model_input(chunks, config.block_size))
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - cache_bytes
    runner.release_cache()
    torch.cuda.empty_cache()
    return peak
