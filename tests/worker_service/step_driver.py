"""Drives a worker core (one process, or rank 0 of a tensor-parallel group) with hand-built Step
messages, as a scheduler would: new sequences with their whole block table, prompt chunks, decode
steps; plus transformers' view of the same checkpoint for references."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from common.contract.config import WorkerConfig
from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# The CPU, and a GPU where there is one (float32 both, CUDA graphs on the GPU).
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def worker_config(model: Path, device: str, **options) -> WorkerConfig:
    """A small worker in float32 (few CUDA graphs to capture on a GPU)."""
    return WorkerConfig(model=str(model), device=device, dtype="float32", block_size=BLOCK_SIZE,
                        num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_num_batched_tokens=256, **options)


class StepDriver:
    def __init__(self, core, blocks_per_sequence: int = 6,
                 grammar_tokenizer: worker_pb2.GrammarTokenizer | None = None) -> None:
        """grammar_tokenizer: sent with InitCache, so that new sequences may come with a grammar."""
        self.core = core
        core.init_cache(worker_pb2.InitCacheRequest(num_kv_blocks=NUM_BLOCKS, session_id="test",
                                                    grammar_tokenizer=grammar_tokenizer))
        self.step_id = 0
        self.blocks_per_sequence = blocks_per_sequence
        self.next_block = 0

    def new(self, seq_id: int, prompt: Sequence[int], params: SamplingParams, *, chunk: int | None = None,
            banned: Sequence[int] = (), mask: worker_pb2.TokenMask | None = None) -> worker_pb2.NewSequence:
        """A sequence's first message: the first `chunk` prompt tokens (all by default)."""
        message = worker_pb2.NewSequence(seq_id=seq_id, token_ids=list(prompt[:chunk]), num_tokens=len(prompt),
                                         num_prompt_tokens=len(prompt), block_table=self.blocks(),
                                         sampling=params.to_proto())
        message.sampling.min_tokens_banned_ids.extend(banned)
        if mask is not None:
            message.token_mask.CopyFrom(mask)
        return message

    def blocks(self) -> list[int]:
        """A block table of its own for a new sequence."""
        self.next_block += self.blocks_per_sequence
        return list(range(self.next_block - self.blocks_per_sequence, self.next_block))

    def step(self, new: Sequence[worker_pb2.NewSequence] = (), running: Sequence[worker_pb2.RunningSequence] = (),
             num_decode_steps: int = 0, released: Sequence[int] = ()) -> worker_pb2.StepResponse:
        return self.launch(new, running, num_decode_steps, released).result()

    def launch(self, new: Sequence[worker_pb2.NewSequence] = (), running: Sequence[worker_pb2.RunningSequence] = (),
               num_decode_steps: int = 0, released: Sequence[int] = ()):
        """Launches the next step without reading it back (its PendingStep): a scheduler's lookahead."""
        self.step_id += 1
        request = worker_pb2.StepRequest(step_id=self.step_id, session_id="test", new_sequences=new,
                                         running_sequences=running, num_decode_steps=num_decode_steps,
                                         released_seq_ids=released)
        return self.core.launch(request)


def running(seq_id: int, token_ids: Sequence[int] = (), mask: worker_pb2.TokenMask | None = None
            ) -> worker_pb2.RunningSequence:
    message = worker_pb2.RunningSequence(seq_id=seq_id, token_ids=token_ids)
    if mask is not None:
        message.token_mask.CopyFrom(mask)
    return message


def tokens_of(response: worker_pb2.StepResponse, seq_id: int) -> list[int]:
    return [t.token_id for t in response.tokens if t.seq_id == seq_id]


class Reference:
    """transformers' float32 logits of the checkpoint (CPU)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[len(token_ids), vocab] float32: position p's logits predict token p + 1."""
        return self.model(torch.tensor([list(token_ids)])).logits[0].float()
