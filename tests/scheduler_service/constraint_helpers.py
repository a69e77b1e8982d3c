"""Shared by the structured-output tests: the tiny byte-level BPE tokenizer (a real one llguidance
reads), a compiler for it, and a fake worker's sampling that obeys a step's token masks."""
from __future__ import annotations

import random
from pathlib import Path

from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.api.tokenizer import Tokenizer, load_tokenizer
from scheduler_service.constraints import allowed_token_ids
from scheduler_service.core.step_builder import InFlightStep
from tests.tiny_models import save_tiny_bpe_tokenizer

# Wider than the tokenizer's 474 tokens, as a model's padded embedding is: ids 474..511 are no text.
VOCAB_SIZE = 512


def tiny_tokenizer(folder: Path) -> Tokenizer:
    tokenizer = load_tokenizer(str(save_tiny_bpe_tokenizer(folder)))
    assert tokenizer is not None and tokenizer.vocab_size < VOCAB_SIZE
    return tokenizer


def worker_info(tokenizer: Tokenizer, **changes) -> WorkerDescription:
    values = dict(model_name="fake", dtype="fake", block_size=16, max_model_len=256, vocab_size=VOCAB_SIZE,
                  num_kv_blocks=64, device="fake", eos_token_ids=(tokenizer.eos_token_id,))
    return WorkerDescription(**{**values, **changes})


def messages(step: InFlightStep) -> list:
    return [*step.request.new_sequences, *step.request.running_sequences]


def masked_reply(step: InFlightStep, rng: random.Random, pick=None) -> worker_pb2.StepResponse:
    """One token per sequence that samples (new ones, and decodes): from its mask when it has one
    (pick(allowed ids) or a random allowed id), else token 5."""
    response = worker_pb2.StepResponse(step_id=step.step_id)
    for message in messages(step):
        if not message.HasField("token_mask"):
            response.tokens.add(seq_id=message.seq_id, token_id=5)
            continue
        allowed = [int(t) for t in allowed_token_ids(message.token_mask, VOCAB_SIZE)]
        token_id = pick(allowed) if pick is not None else rng.choice(allowed)
        response.tokens.add(seq_id=message.seq_id, token_id=token_id)
    return response
