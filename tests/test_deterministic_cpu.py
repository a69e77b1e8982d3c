"""--deterministic on the CPU, end to end through the offline LLM on tiny random models (float32
weights, and int4 from a GGUF of Q4_0 tensors): greedy and seeded prompts get the same tokens, logprobs
and top logprobs, bit for bit, whether they run alone, together, among other prompts, in prefill
chunks of 24 tokens, from the prefix cache or preempted and recomputed. Without the mode the same
runs differ (the control: these checks can fail)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.deterministic_runs import (
    WAYS,
    default_kernels_afterwards,  # noqa: F401 (autouse)
    differing_ways,
)
from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.test_tp_sharding import write_gguf

VOCAB_SIZE = 512
# Shapes of whole 64-column chunks: 4 chunks into o_proj, 18 into down_proj; head_dim 64.
SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden_size=256, intermediate_size=1152,
             vocab_size=VOCAB_SIZE, max_position_embeddings=512)
OTHER_WAYS = [way for way in WAYS if way != "alone"]


@pytest.fixture(scope="module")
def float32_model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("det"), "qwen3", seed=11, **SHAPE)


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory) -> Path:
    gguf = pytest.importorskip("gguf")
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("det-int4"), "qwen3", seed=12, **SHAPE)
    return write_gguf(folder, gguf.GGMLQuantizationType.Q4_0, VOCAB_SIZE)


def test_float32_outputs_do_not_depend_on_the_batch(float32_model: Path, monkeypatch) -> None:
    assert differing_ways(float32_model, monkeypatch, OTHER_WAYS, deterministic=True, vocab_size=VOCAB_SIZE) == {}


def test_int4_outputs_do_not_depend_on_the_batch(int4_model: Path, monkeypatch) -> None:
    assert differing_ways(int4_model, monkeypatch, OTHER_WAYS, deterministic=True, cpu_weight_format="int4",
                          vocab_size=VOCAB_SIZE) == {}


def test_without_the_mode_they_do(float32_model: Path, int4_model: Path, monkeypatch) -> None:
    ways = ["together", "prefill chunks of 24"]
    assert differing_ways(float32_model, monkeypatch, ways, vocab_size=VOCAB_SIZE)
    assert differing_ways(int4_model, monkeypatch, ways, cpu_weight_format="int4", vocab_size=VOCAB_SIZE)
