"""Sampling through the whole engine: seeded requests reproduce alone, inside a mixed batch and
after preemption; bad options and sampling parameters raise ValueError naming the field."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common import SamplingParams
from offline import LLM
from tests.tiny_models import make_tiny_checkpoint

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=40, ignore_eos=True)
PROMPT = [5, 17, 99, 3, 250, 41, 8]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("seeded"), "qwen3")


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(model: Path) -> None:
    llm = LLM(str(model), block_size=16, num_kv_blocks=64)
    alone = llm.generate([PROMPT], SEEDED, use_tqdm=False)[0]["token_ids"]
    prompts = [[1, 2, 3], PROMPT, list(range(40, 90)), [7] * 12]
    params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True), SEEDED,
              SamplingParams(temperature=0.5, seed=9, max_tokens=50, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True)]
    assert llm.generate(prompts, params, use_tqdm=False)[1]["token_ids"] == alone
    # A different seed gives a different sequence (the seed is really used).
    assert llm.generate([PROMPT], replace(SEEDED, seed=4321), use_tqdm=False)[0]["token_ids"] != alone


def test_seeded_request_survives_preemption(model: Path) -> None:
    alone = LLM(str(model), block_size=16, num_kv_blocks=64).generate([PROMPT], SEEDED, use_tqdm=False)[0]
    tight = LLM(str(model), block_size=16, num_kv_blocks=6)
    prompts = [PROMPT, list(range(100, 140)), list(range(200, 230))]
    params = [SEEDED, SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=40, ignore_eos=True)]
    results = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert results[0]["token_ids"] == alone["token_ids"]


@pytest.mark.parametrize(("options", "field"), [
    ({"block_size": 24}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"dtype": "int8"}, "dtype"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_invalid_options_raise_value_error_naming_the_field(model: Path, options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        LLM(str(model), **options)


@pytest.mark.parametrize(("params", "field"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop": ["x"] * 17}, "stop"),
])
def test_invalid_sampling_params_raise_value_error_naming_the_field(params: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**params)


def test_prompt_too_long_raises_naming_the_prompt(model: Path) -> None:
    llm = LLM(str(model), block_size=16, num_kv_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="^prompt: 64 tokens, the limit is 63"):
        llm.generate([[1] * 64], SamplingParams(), use_tqdm=False)
    assert llm.engine.stats().num_free_kv_blocks == 64


def test_sequence_longer_than_the_kv_pool_stops_at_its_capacity(model: Path) -> None:
    llm = LLM(str(model), block_size=16, num_kv_blocks=4)  # 64 tokens in all
    assert llm.engine.max_model_len == 64
    result = llm.generate([list(range(10))], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                          use_tqdm=False)[0]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 54
    assert llm.engine.stats().num_free_kv_blocks == 4


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 0.5}, {"presence_penalty": 0.7},
                                     {"repetition_penalty": 1.3}])
def test_penalised_request_with_a_prefix_hit_equals_the_cold_one(model: Path, penalty: dict) -> None:
    """The worker needs every earlier token for a penalty, the cached prefix included."""
    llm = LLM(str(model), block_size=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penalty)
    cold = llm.generate([list(range(40))], params, use_tqdm=False)[0]["token_ids"]
    hits_before = llm.engine.stats().num_prefix_hit_tokens
    warm = llm.generate([list(range(40))], params, use_tqdm=False)[0]["token_ids"]
    assert llm.engine.stats().num_prefix_hit_tokens - hits_before == 32
    assert warm == cold
