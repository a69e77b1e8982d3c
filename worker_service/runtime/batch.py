"""Builds the tensors of one forward pass from a Step: token ids, positions, KV slots and the
attention metadata. Pure bookkeeping on the host; the runner moves the result to the device."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.attention.base import AttentionMetadata
from worker_service.runtime.sequence_state import PendingToken, WorkerSequence
from worker_service.sampling.sampling_state import SamplingRows


@dataclass
class ScheduledChunk:
    state: WorkerSequence
    token_ids: list[int]  # the tokens to compute, starting at state.num_computed_tokens
    samples: bool  # the chunk reaches the end of the sequence
    # For a decode chunk whose token an earlier step sampled and has not read back yet; token_ids
    # then holds a placeholder that the device fills in.
    token_source: PendingToken | None = None


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: the last token of each sampling chunk
    sampled_chunks: list[ScheduledChunk]
    # Tokens to take from earlier steps' device outputs, by input position.
    position_to_token_source: dict[int, PendingToken] = field(default_factory=dict)


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
    """A chunk of tokens the scheduler sent (not the worker's own last sampled token)."""
    if not token_ids:
        raise ValueError(f"sequence {state.seq_id}: empty chunk")
    end = state.num_computed_tokens + len(token_ids)
    if state.token_ids is not None:
        state.token_ids.extend(token_ids)
    return ScheduledChunk(state, token_ids, samples=end >= state.num_tokens)


def build_model_input(chunks: list[ScheduledChunk], block_size: int) -> ModelInput:
    """Vectorised over the batch: per-sequence Python work is limited to reading its counters and
    copying its block table into one array."""
    num_seqs = len(chunks)
    query_lens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((c.state.num_computed_tokens for c in chunks), dtype=np.int64, count=num_seqs)
    table_lens = np.fromiter((len(c.state.block_table) for c in chunks), dtype=np.int64, count=num_seqs)
    ends = starts + query_lens
    too_long = np.nonzero(ends > table_lens * block_size)[0]
    if too_long.size:
        state = chunks[too_long[0]].state
        raise ValueError(f"sequence {state.seq_id}: {ends[too_long[0]]} tokens exceed its "
                         f"{len(state.block_table)} blocks of {block_size}")
    tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int32)
    for row, chunk in enumerate(chunks):
        tables[row, :table_lens[row]] = chunk.state.block_table
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    if num_tokens == num_seqs:  # decode only: one token per sequence
        rows, positions = np.arange(num_seqs), starts
        input_ids = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=num_seqs)
    else:
        rows = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - starts, query_lens)
        input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                count=num_tokens)
    slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    samples = np.fromiter((c.samples for c in chunks), dtype=bool, count=num_seqs)
    token_sources = {int(query_start[row]): chunk.token_source for row, chunk in enumerate(chunks)
                     if chunk.token_source is not None}
    seq_lens = ends.astype(np.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(tables),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(ends.max()),
        block_size=block_size,
        query_lens_host=query_lens.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return ModelInput(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions.astype(np.int64, copy=False)),
        metadata=metadata,
        logits_indices=torch.from_numpy(query_start[1:][samples] - 1),
        sampled_chunks=[c for c in chunks if c.samples],
        position_to_token_source=token_sources,
    )


def sampling_rows(chunks: list[ScheduledChunk]) -> SamplingRows:
    """The sampling rows of the chunks that sample, in order."""
    states = [chunk.state for chunk in chunks]
    params = [state.sampling for state in states]
    indices = [state.num_tokens - state.num_prompt_tokens for state in states]
    if all(state.token_ids is None for state in states):  # no penalties: no token lists to slice
        return SamplingRows(params, [None] * len(states), [()] * len(states), indices)
    prompts: list[list[int] | None] = []
    outputs: list[list[int]] = []
    for state in states:
        history = state.token_ids
        prompts.append(None if history is None else history[:state.num_prompt_tokens])
        outputs.append([] if history is None else history[state.num_prompt_tokens:])
    return SamplingRows(params, prompts, outputs, indices)
