"""Builds the tensors of one forward pass from the chunks a step computes: token ids, positions, KV
slots and the attention metadata, each moved to the step's device as it is built. Pure bookkeeping:
it reads sequence state and never changes it."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_service.attention.base import AttentionMetadata, longest_first
from worker_service.runtime.sequence_state import PendingToken, WorkerSequence
from worker_service.sampling.sampling_state import SamplingRows, host_to_device

HOST = torch.device("cpu")


@dataclass
class ScheduledChunk:
    state: WorkerSequence
    token_ids: list[int]  # the tokens to compute, starting at state.num_computed_tokens
    samples: bool  # the chunk reaches the end of the sequence
    # For a decode chunk whose token an earlier step sampled and has not read back yet; token_ids
    # then holds a placeholder that the device fills in.
    token_source: PendingToken | None = None
    # The packed allowed tokens of this step's sample (token_masks.decode_token_mask, or for a sequence
    # under a grammar its matcher's, set once the forward pass is queued); only on a chunk that samples.
    token_mask: np.ndarray | None = None

    @property
    def scores_prompt(self) -> bool:
        """The sequence asked for prompt logprobs and the chunk computes prompt positions."""
        state = self.state
        return state.sampling.num_prompt_logprobs is not None and state.num_computed_tokens < state.num_prompt_tokens


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: the last token of each sampling chunk
    sampled_chunks: list[ScheduledChunk]
    block_tables_host: np.ndarray  # metadata.block_tables, as built on the host
    # Tokens to take from earlier steps' device outputs, by input position.
    position_to_token_source: dict[int, PendingToken] = field(default_factory=dict)
    # The chunks whose prompt positions are scored (prompt logprobs), each with the input index of
    # its first token.
    prompt_chunks: list[tuple[int, ScheduledChunk]] = field(default_factory=list)


def build_model_input(chunks: list[ScheduledChunk], block_size: int, device: torch.device = HOST) -> ModelInput:
    """Vectorised over the batch: per-sequence Python work is limited to reading its counters and
    copying its block table into one array. The tensors are on device (on the CPU, no copy)."""
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
    move = lambda array: host_to_device(torch.from_numpy(array), device)  # noqa: E731
    metadata = AttentionMetadata(slot_mapping=move(slots), query_start_loc=move(query_start.astype(np.int32)),
                                 seq_lens=move(seq_lens), block_tables=move(tables),
                                 max_query_len=int(query_lens.max()), max_seq_len=int(ends.max()),
                                 block_size=block_size, query_lens_host=query_lens.tolist(),
                                 seq_lens_host=seq_lens.tolist(),
                                 decode_order=move(longest_first(seq_lens)) if num_tokens == num_seqs else None)
    return ModelInput(input_ids=move(input_ids), positions=move(positions.astype(np.int64, copy=False)),
                      metadata=metadata, logits_indices=move(query_start[1:][samples] - 1),
                      sampled_chunks=[c for c in chunks if c.samples], block_tables_host=tables,
                      position_to_token_source=token_sources,
                      prompt_chunks=[(int(query_start[row]), c) for row, c in enumerate(chunks) if c.scores_prompt])


def sampling_rows(chunks: list[ScheduledChunk]) -> SamplingRows:
    """The sampling rows of the chunks that sample, in order."""
    states = [chunk.state for chunk in chunks]
    params = [state.sampling for state in states]
    indices = [state.num_tokens - state.num_prompt_tokens for state in states]
    edits = dict(token_masks=[chunk.token_mask for chunk in chunks],
                 min_tokens_banned_ids=[state.min_tokens_banned_ids for state in states],
                 logit_biases=[state.logit_bias for state in states])
    if all(state.token_ids is None for state in states):  # no penalties: no token lists to slice
        return SamplingRows(params, [None] * len(states), [()] * len(states), indices, **edits)
    prompts = [None if s.token_ids is None else s.token_ids[:s.num_prompt_tokens] for s in states]
    outputs = [[] if s.token_ids is None else s.token_ids[s.num_prompt_tokens:] for s in states]
    return SamplingRows(params, prompts, outputs, indices, **edits)
