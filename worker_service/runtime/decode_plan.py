"""The positions, KV slots and context lengths of every iteration of a multi-iteration decode step,
computed on the host at once and copied to the device in one go: each iteration's own metadata."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from worker_service.attention.base import AttentionMetadata
from worker_service.runtime.batch import ModelInput
from worker_service.sampling.sampling_state import host_to_device


@dataclass
class DecodePlan:
    positions: torch.Tensor  # [num_decode_steps, num_seqs] int64
    slot_mapping: torch.Tensor  # [num_decode_steps, num_seqs] int64
    seq_lens: torch.Tensor  # [num_decode_steps, num_seqs] int32
    seq_lens_host: np.ndarray  # [num_decode_steps, num_seqs]

    @classmethod
    def build(cls, model_input: ModelInput, num_decode_steps: int, block_size: int,
              device: torch.device) -> DecodePlan:
        chunks = model_input.sampled_chunks
        if len(chunks) != model_input.metadata.num_seqs or model_input.metadata.max_query_len != 1:
            raise ValueError("num_decode_steps: every sequence of a multi-iteration step must decode")
        starts = np.fromiter((c.state.num_computed_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        positions = starts[None, :] + np.arange(num_decode_steps, dtype=np.int64)[:, None]
        tables = model_input.block_tables_host
        needed = positions[-1] // block_size
        if np.any(needed >= np.fromiter((len(c.state.block_table) for c in chunks), dtype=np.int64,
                                        count=len(chunks))):
            raise ValueError("num_decode_steps: a sequence has too few blocks for every iteration")
        rows = np.arange(len(chunks))[None, :]
        slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
        seq_lens = (positions + 1).astype(np.int32)
        move = lambda array: host_to_device(torch.from_numpy(array), device)  # noqa: E731
        return cls(move(positions), move(slots), move(seq_lens), seq_lens)

    def metadata(self, first: AttentionMetadata, index: int) -> AttentionMetadata:
        """The metadata of iteration index (> 0), from the first iteration's."""
        return replace(first, slot_mapping=self.slot_mapping[index], seq_lens=self.seq_lens[index],
                       max_seq_len=first.max_seq_len + index, seq_lens_host=self.seq_lens_host[index].tolist())
