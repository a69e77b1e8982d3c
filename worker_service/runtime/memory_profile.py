"""The warm-up steps by which a GPU worker measures the memory it needs besides its KV cache
(ModelRunner._warmup_peak_memory): one of the largest size it serves (max_num_batched_tokens of
prefill, logits and sampling for max_num_seqs rows, through the sampler's most memory-hungry path),
over a temporary cache just large enough for it."""
from __future__ import annotations

from common.contract.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from worker_service.runtime.batch import ScheduledChunk
from worker_service.runtime.sequence_state import WorkerSequence

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

