"""Builds the tensors of one forward pass from a Step: token ids, positions, KV slots and the
attention metadata. Pure bookkeeping on the host; the runner moves the result to the device."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.attention.base import AttentionMetadata
from worker_service.sequence_state import WorkerSequence


@dataclass
class ScheduledChunk:
    state: WorkerSequence
    token_ids: list[int]  # the tokens to compute, starting at state.num_computed_tokens
    samples: bool  # the chunk reaches the end of the sequence
    # For a decode chunk whose token an earlier step sampled and has not read back yet: (that step,
    # its row); token_ids then holds a placeholder that the device fills in.
    token_source: tuple[Any, int] | None = None


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: the last token of each sampling chunk
    sampled_chunks: list[ScheduledChunk]
    # Tokens to take from earlier steps' device outputs: input position -> (step, row).
    token_sources: dict[int, tuple[Any, int]] = field(default_factory=dict)


def apply_step(request: worker_pb2.StepRequest, seq_id_to_state: dict[int, WorkerSequence]) -> list[ScheduledChunk]:
    """Updates per-sequence state from the step's deltas and lists what to compute, in order."""
    for seq_id in request.released_seq_ids:
        seq_id_to_state.pop(seq_id, None)
    chunks: list[ScheduledChunk] = []
    for new in request.new_sequences:
        if new.seq_id in seq_id_to_state:
            raise ValueError(f"sequence {new.seq_id} is already held; release it first")
        state = WorkerSequence.from_message(new)
        seq_id_to_state[new.seq_id] = state
        chunks.append(_chunk(state, list(new.token_ids)))
    for running in request.running_sequences:
        state = seq_id_to_state.get(running.seq_id)
        if state is None:
            raise ValueError(f"sequence {running.seq_id} is unknown to this worker")
        state.block_table.extend(running.new_block_ids)
        if running.token_ids:
            state.num_tokens = max(state.num_tokens, state.num_computed_tokens + len(running.token_ids))
            chunks.append(_chunk(state, list(running.token_ids)))
        elif state.pending is not None:
            chunks.append(ScheduledChunk(state, [0], samples=True, token_source=state.pending))
        elif state.last_token is not None:
            chunks.append(ScheduledChunk(state, [state.last_token], samples=True))
        else:
            raise ValueError(f"sequence {running.seq_id}: no tokens to compute and no sampled token")
    return chunks


def _chunk(state: WorkerSequence, token_ids: list[int]) -> ScheduledChunk:
    if not token_ids:
        raise ValueError(f"sequence {state.seq_id}: empty chunk")
    """A chunk of tokens the scheduler sent (not the worker's own last sampled token)."""
    end = state.num_computed_tokens + len(token_ids)
    if state.token_ids is not None:
        state.token_ids.extend(token_ids)
    return ScheduledChunk(state, token_ids, samples=end >= state.num_tokens)


def build_model_input(chunks: list[ScheduledChunk], block_size: int) -> ModelInput:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    token_sources: dict[int, tuple[Any, int]] = {}
    for chunk in chunks:
        state = chunk.state
        start = state.num_computed_tokens
        end = start + len(chunk.token_ids)
        if end > len(state.block_table) * block_size:
            raise ValueError(f"sequence {state.seq_id}: {end} tokens exceed its "
                             f"{len(state.block_table)} blocks of {block_size}")
        table = state.block_table
        if chunk.token_source is not None:
            token_sources[len(input_ids)] = chunk.token_source
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(query_start[-1] + end - start)
        seq_lens.append(end)
        if chunk.samples:
            logits_indices.append(query_start[-1] - 1)
    max_blocks = max(len(c.state.block_table) for c in chunks)
    tables = torch.zeros((len(chunks), max_blocks), dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        tables[row, :len(chunk.state.block_table)] = torch.tensor(chunk.state.block_table, dtype=torch.int32)
    query_lens = [b - a for a, b in zip(query_start, query_start[1:], strict=False)]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    return ModelInput(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        metadata=metadata,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        sampled_chunks=[c for c in chunks if c.samples],
        token_sources=token_sources,
    )
