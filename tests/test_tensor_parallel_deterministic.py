"""--deterministic under tensor parallelism on CPUs (two processes, gloo): greedy and seeded prompts get
one process's tokens, logprobs and top logprobs bit for bit, the two-rank run chunking its prefills,
hitting the prefix cache and preempting; without the mode two ranks' logprobs differ from one's even
with each prompt alone (the control)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.deterministic_runs import (
    EVERY,
    WAYS,
    default_kernels_afterwards,  # noqa: F401 (autouse)
    generate,
)
from tests.tiny_models import make_tiny_checkpoint

VOCAB_SIZE = 509  # the second rank's slice of the vocabulary ends in padding
# Each rank: 2 heads of 64 (2 chunks into o_proj), 576 of the intermediate size (9 chunks into down_proj).
SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256, intermediate_size=1152,
             vocab_size=VOCAB_SIZE, max_position_embeddings=512, tie=True)
# Prefill chunks of 24 tokens, 16 blocks (preemption), the first prompt before the others (prefix hits).
EVERYTHING = dict(max_num_batched_tokens=24, num_kv_blocks=16)
EVERYTHING_BATCHES = [[0], EVERY[::-1]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("det-tp"), "llama", seed=13, **SHAPE)


def test_two_ranks_answer_as_one(model: Path, monkeypatch) -> None:
    alone_options, alone_batches = WAYS["alone"]
    one, _ = generate(model, alone_batches, monkeypatch, deterministic=True, vocab_size=VOCAB_SIZE, **alone_options)
    two, llm = generate(model, EVERYTHING_BATCHES, monkeypatch, deterministic=True, vocab_size=VOCAB_SIZE,
                        tensor_parallel_size=2, **EVERYTHING)
    assert two == one
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens >= 70


def test_without_the_mode_two_ranks_differ(model: Path, monkeypatch) -> None:
    alone_options, alone_batches = WAYS["alone"]
    one, _ = generate(model, alone_batches, monkeypatch, vocab_size=VOCAB_SIZE, **alone_options)
    two, _ = generate(model, alone_batches, monkeypatch, vocab_size=VOCAB_SIZE, tensor_parallel_size=2,
                      **alone_options)
    assert two != one
