"""Measures the GPU memory a worker needs besides its KV cache: a warm-up step of the largest size
it serves (max_num_batched_tokens of prefill, logits and sampling for max_num_seqs rows, through the
sampler's most memory-hungry path), run over a temporary cache just large enough for it. A second,
small step compiles the fused sampling kernel, so that no request waits for that."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from worker_service.batch import ScheduledChunk, build_model_input
from worker_service.sequence_state import WorkerSequence

if TYPE_CHECKING:
    from worker_service.model_runner import ModelRunner

# Filtering by sort, top log-probabilities: the sampler's largest [rows, vocab] intermediates.
HEAVIEST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=True,
                                   num_top_logprobs=MAX_TOP_LOGPROBS)
# Temperature alone: the fused sampling kernel on CUDA.
PLAIN_SAMPLING = SamplingParams(temperature=1.0)


def warmup_chunks(num_tokens: int, num_seqs: int, block_size: int,
                  sampling: SamplingParams = PLAIN_SAMPLING) -> list[ScheduledChunk]:
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


def profile_peak_memory(runner: ModelRunner) -> int:
    """Peak bytes allocated by torch during the warm-up step, without the temporary cache."""
    config = runner.config
    chunks = warmup_chunks(config.max_num_batched_tokens, config.max_num_seqs, config.block_size, HEAVIEST_SAMPLING)
    num_blocks = sum(len(c.state.block_table) for c in chunks)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(runner.device)
    runner.init_cache(num_blocks, capture_graphs=False)
    cache_bytes = num_blocks * runner.kv_spec.bytes_per_block  # K/V (and fp8 scales)
    runner.run(build_model_input(chunks, config.block_size))
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - cache_bytes
    plain = warmup_chunks(2, min(2, num_blocks), config.block_size, PLAIN_SAMPLING)
    runner.run(build_model_input(plain, config.block_size))
    torch.cuda.synchronize(runner.device)
    runner.release_cache()
    torch.cuda.empty_cache()
    return peak
