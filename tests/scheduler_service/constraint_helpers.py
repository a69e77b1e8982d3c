"""Shared by the structured-output tests: the tiny byte-level BPE tokenizer (a real one llguidance
reads), a compiler for it, and a fake worker's sampling that obeys a step's token masks, or that
advances each sequence's grammar itself (--grammar-masks worker)."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from common.contract.grammar_tokenizer import GrammarTokenizer, fill_bitmask, new_matcher
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


class GrammarSampler:
    """A fake worker's sampling for sequences whose grammar it advances: a matcher per sequence from its
    NewSequence.grammar (past its output tokens), a random allowed token each decode iteration, consumed
    at once, as the worker does; token 5 for free text. Replies must be made in step order."""

    def __init__(self, spec: GrammarTokenizer, rng: random.Random) -> None:
        self.spec = spec
        self.tokenizer = spec.build()
        self.rng = rng
        self.seq_id_to_matcher: dict[int, object] = {}
        self.num_grammars = 0  # NewSequence messages that carried one

    def reply(self, step_id: int, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        for seq_id in request.released_seq_ids:
            self.seq_id_to_matcher.pop(seq_id, None)
        for new in request.new_sequences:
            if new.HasField("grammar"):
                self.num_grammars += 1
                matcher = new_matcher(self.tokenizer, new.grammar.grammar)
                assert matcher.consume_tokens(list(new.grammar.output_token_ids))
                self.seq_id_to_matcher[new.seq_id] = matcher
        response = worker_pb2.StepResponse(step_id=step_id)
        for message in (*request.new_sequences, *request.running_sequences):
            assert not message.HasField("token_mask")
            matcher = self.seq_id_to_matcher.get(message.seq_id)
            if matcher is None:
                for _ in range(max(request.num_decode_steps, 1)):
                    response.tokens.add(seq_id=message.seq_id, token_id=5)
            else:
                for _ in range(max(request.num_decode_steps, 1)):
                    response.tokens.add(seq_id=message.seq_id, token_id=self._sample(matcher))
        return response

    def _sample(self, matcher) -> int:
        bitmask = np.zeros(self.spec.num_bitmask_words, dtype=np.int32)
        fill_bitmask(matcher, self.spec, bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:self.spec.vocab_size]
        token_id = int(self.rng.choice(np.flatnonzero(bits).tolist()))
        if token_id not in self.spec.padded_eos_token_ids:
            assert matcher.consume_token(token_id)
        return token_id
