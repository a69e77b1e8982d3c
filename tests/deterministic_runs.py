"""Runs of one workload through the offline LLM in different ways (alone, together, among other
prompts, in prefill chunks, from the prefix cache, preempted), each prompt's tokens and logprobs
recorded, for the --deterministic tests (test_deterministic_cpu.py, test_tensor_parallel_deterministic.py)."""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common import SamplingParams
from offline import LLM
from offline import llm as llm_module
from worker_service import invariant

NUM_PROMPTS = 8
MAX_TOKENS = 24
NOISE = -1  # a prompt index: a random prompt of its own, run beside the workload's


@pytest.fixture(autouse=True)
def default_kernels_afterwards() -> Iterator[None]:
    """The mode's kernels are process-wide: the next tests get the default ones back."""
    yield
    invariant.disable()


@dataclass(frozen=True)
class Answer:
    """A prompt's tokens, their logprobs and their top-2 alternatives, bit for bit."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]


def workload(vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 3 to 150 tokens (the last three share the first's 70-token prefix), greedy and seeded
    sampling in turn, every one asking for logprobs."""
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(3, 150))] for _ in range(NUM_PROMPTS - 3)]
    prompts[0] = [rng.randrange(vocab_size) for _ in range(80)]
    prompts += [prompts[0][:70] + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else 100 + i,
                             max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, num_top_logprobs=2)
              for i in range(NUM_PROMPTS)]
    return prompts, params


# name -> (LLM options, batches: lists of prompt indexes run one generate call after another)
EVERY = list(range(NUM_PROMPTS))
WAYS: dict[str, tuple[dict[str, Any], list[list[int]]]] = {
    "alone": (dict(enable_prefix_caching=False), [[i] for i in EVERY]),
    "together": ({}, [EVERY]),
    "among others": ({}, [[NOISE, 3, NOISE, NOISE, 0, 5], [7, NOISE, 1, 2, NOISE, 4, 6, NOISE]]),
    "prefill chunks of 24": (dict(max_num_batched_tokens=24), [EVERY]),
    "from the prefix cache": ({}, [[0], EVERY[::-1]]),
    "preempted": (dict(num_kv_blocks=16, max_num_batched_tokens=64), [EVERY]),
}


def generate(path: Path, batches: list[list[int]], monkeypatch: pytest.MonkeyPatch,
             **options: Any) -> tuple[dict[int, Answer], LLM]:
    """Each workload prompt's answer, the prompts run in the given batches; and the (closed) LLM."""
    prompts, params = workload(options.pop("vocab_size"))
    noise = random.Random(1)
    recorded: dict[int, list[Any]] = {}
    real_on_step = llm_module._Progress.on_step

    def on_step(progress: Any, step: Any, outputs: list[Any], period_s: float | None) -> None:
        for output in outputs:
            entry = recorded.setdefault(output.seq_id, [[], []])
            entry[0] += output.logprobs
            entry[1] += [tuple(top) for top in output.top_logprobs]
        real_on_step(progress, step, outputs, period_s)

    monkeypatch.setattr(llm_module._Progress, "on_step", on_step)
    answers = {}
    with LLM(str(path), **{"block_size": 16, "num_kv_blocks": 256, "device": "cpu", **options}) as llm:
        for batch in batches:
            batch_prompts = [prompts[i] if i != NOISE else [noise.randrange(300) for _ in range(noise.randint(3, 90))]
                             for i in batch]
            batch_params = [params[i] if i != NOISE else params[1] for i in batch]
            before = set(recorded)
            results = llm.generate(batch_prompts, batch_params, use_tqdm=False)
            seq_ids = sorted(set(recorded) - before)  # in prompt order: sequences are numbered as queued
            for index, result, seq_id in zip(batch, results, seq_ids, strict=True):
                if index != NOISE:
                    logprobs, top = recorded[seq_id]
                    answers[index] = Answer(tuple(result["token_ids"]), tuple(logprobs), tuple(top))
    return answers, llm


def differing_ways(path: Path, monkeypatch: pytest.MonkeyPatch, ways: list[str], **options: Any) -> dict[str, str]:
    """way -> what differs from the prompts' runs alone ("tokens" or "logprobs"), for the ways that differ."""
    alone, _ = generate(path, WAYS["alone"][1], monkeypatch, **WAYS["alone"][0], **options)
    assert len({answer.token_ids for answer in alone.values()}) > NUM_PROMPTS // 2  # not all the same answer
    differing = {}
    for way in ways:
        answers, llm = generate(path, WAYS[way][1], monkeypatch, **{**options, **WAYS[way][0]})
        stats = llm.engine.stats()
        if way == "preempted":
            assert stats.num_preemptions > 0
        if way == "from the prefix cache":
            assert stats.num_prefix_hit_tokens >= 70
        if any(answers[i].token_ids != alone[i].token_ids for i in EVERY):
            differing[way] = "tokens"
        elif any(answers[i] != alone[i] for i in EVERY):
            differing[way] = "logprobs"
    return differing
