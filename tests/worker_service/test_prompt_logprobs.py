"""Prompt logprobs through whole worker steps (a tiny random Qwen3 on the CPU, float32): every prompt
token after the first gets transformers' float32 log_softmax of the previous position's logits, with
its top alternatives, over chunked prefills whose chunk boundaries (and the runner's blocks of logits
rows) fall anywhere; one entry per chunk, first_position the first token it scores."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.step_driver import DEVICES, Reference, StepDriver, running, tokens_of, worker_config
from worker_service.runtime import prompt_logprobs
from worker_service.runtime.worker import WorkerCore

P = SamplingParams
VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("prompt_logprobs"), "qwen3", seed=5)


@pytest.fixture(scope="module")
def reference(model: Path) -> Reference:
    return Reference(model)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def make_driver(model: Path, device: str) -> StepDriver:
    return StepDriver(WorkerCore(worker_config(model, device)))


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


def run_chunked(driver: StepDriver, seq_to_prompt: dict[int, list[int]], seq_to_params: dict[int, SamplingParams],
                chunk_sizes: dict[int, list[int]]) -> tuple[dict[int, list[worker_pb2.PromptLogprobs]], dict]:
    """Every sequence's prompt in its chunks, one chunk per step, all sequences in each step; the
    prompt logprob entries per sequence, and the step's sampled tokens (with logprobs) per sequence."""
    entries: dict[int, list[worker_pb2.PromptLogprobs]] = {seq_id: [] for seq_id in seq_to_prompt}
    sampled: dict[int, list[worker_pb2.SampledToken]] = {seq_id: [] for seq_id in seq_to_prompt}
    offsets = dict.fromkeys(seq_to_prompt, 0)
    for index in range(max(len(sizes) for sizes in chunk_sizes.values())):
        new, run = [], []
        for seq_id, tokens in seq_to_prompt.items():
            if index >= len(chunk_sizes[seq_id]):
                continue
            size, start = chunk_sizes[seq_id][index], offsets[seq_id]
            offsets[seq_id] += size
            if index == 0:
                new.append(driver.new(seq_id, tokens, seq_to_params[seq_id], chunk=size))
            else:
                run.append(running(seq_id, tokens[start:start + size]))
        response = driver.step(new, run)
        for entry in response.prompt_logprobs:
            entries[entry.seq_id].append(entry)
        for token in response.tokens:
            sampled[token.seq_id].append(token)
    return entries, sampled


def assert_matches_reference(entries: list[worker_pb2.PromptLogprobs], tokens: list[int], num_top: int,
                             logprobs: torch.Tensor) -> None:
    scored = [(entry.first_position + i, t) for entry in entries for i, t in enumerate(entry.tokens)]
    assert [position for position, _ in scored] == list(range(1, len(tokens)))
    for position, token in scored:
        row = logprobs[position - 1]
        assert token.token_id == tokens[position]
        assert token.logprob == pytest.approx(row[tokens[position]].item(), abs=1e-4)
        top = row.topk(num_top)
        assert [t.token_id for t in token.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("rows_per_block", [256, 5, 1])
def test_prompt_logprobs_equal_transformers_over_chunks(model: Path, reference: Reference, rows_per_block: int,
                                                        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences in the same steps: chunks of 16 + 16 + 8 with 5 alternatives, 1 + 20 + 19 with
    none, the whole prompt in one chunk with 3; a fourth without prompt logprobs gets no entry. Each
    chunk's entry starts at its first position (the previous chunk's last logits score it), except
    the first chunk's, at 1; the one-token first chunk scores nothing and has no entry."""
    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGITS_ROWS", rows_per_block)
    prompts = {1: prompt(1, 40), 2: prompt(2, 40), 3: prompt(3, 23), 4: prompt(4, 30)}
    num_top = {1: 5, 2: 0, 3: 3}
    params = {seq_id: P(temperature=0.0, num_prompt_logprobs=n, logprobs=True) for seq_id, n in num_top.items()}
    params[4] = P(temperature=0.0)
    chunks = {1: [16, 16, 8], 2: [1, 20, 19], 3: [23], 4: [10, 20]}
    entries, sampled = run_chunked(make_driver(model, device), prompts, params, chunks)
    assert [e.first_position for e in entries[1]] == [1, 16, 32]
    assert [e.first_position for e in entries[2]] == [1, 21]
    assert [len(e.tokens) for e in entries[2]] == [20, 19]
    assert [e.first_position for e in entries[3]] == [1] and entries[4] == []
    for seq_id, n in num_top.items():
        logprobs = torch.log_softmax(reference.logits(prompts[seq_id]), dim=-1)
        assert_matches_reference(entries[seq_id], prompts[seq_id], n, logprobs)
        # The last prompt position's logits score the first output token, with the sampled logprob.
        (first,) = sampled[seq_id]
        assert first.token_id == int(logprobs[-1].argmax())
        assert first.logprob == pytest.approx(logprobs[-1, first.token_id].item(), abs=1e-4)
        assert all(t.seq_id == 0 for e in entries[seq_id] for t in e.tokens)


def test_prompt_logprobs_after_a_prefix_the_worker_did_not_compute(model: Path, reference: Reference,
                                                                   device: str) -> None:
    """A sequence arriving with cached tokens (its prefix computed by another sequence) has no logits
    for its first new position: its first entry starts one later; decode steps add none."""
    driver = make_driver(model, device)  # lone prefills: on a GPU, through a prefill graph where the backend has them
    tokens = prompt(9, 30)
    blocks = driver.blocks()  # sequence 2 computes the prefix into them; sequence 3 starts after it
    prefix = worker_pb2.NewSequence(seq_id=2, token_ids=tokens[:16], num_tokens=30, num_prompt_tokens=30,
                                    block_table=blocks, sampling=P(temperature=0.0).to_proto())
    driver.step([prefix])
    late = worker_pb2.NewSequence(seq_id=3, token_ids=tokens[16:], num_computed_tokens=16, num_tokens=30,
                                  num_prompt_tokens=30, block_table=blocks,
                                  sampling=P(temperature=0.0, num_prompt_logprobs=2).to_proto())
    response = driver.step([late])
    (entry,) = response.prompt_logprobs
    assert entry.seq_id == 3 and entry.first_position == 17 and len(entry.tokens) == 13
    logprobs = torch.log_softmax(reference.logits(tokens), dim=-1)
    for offset, token in enumerate(entry.tokens):
        assert token.token_id == tokens[17 + offset]
        assert token.logprob == pytest.approx(logprobs[16 + offset, token.token_id].item(), abs=1e-4)
    response = driver.step(running=[running(3)])
    assert len(tokens_of(response, 3)) == 1 and not response.prompt_logprobs


@pytest.mark.gpu
def test_cuda_scoring_has_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring a chunk (blocks of logits, the kept tail, targets copied in) never waits for the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from worker_service.runtime.batch import ScheduledChunk
    from worker_service.runtime.sequence_state import WorkerSequence

    monkeypatch.setattr(prompt_logprobs, "PROMPT_LOGITS_ROWS", 64)
    weight = torch.randn(151936, 256, device="cuda", dtype=torch.bfloat16)
    state = WorkerSequence(seq_id=1, block_table=[], num_computed_tokens=100, num_tokens=1000, num_prompt_tokens=1000,
                           sampling=P(num_prompt_logprobs=5), prompt_logits_tail=torch.randn(1, 151936, device="cuda"))
    chunk = ScheduledChunk(state, prompt(4, 300), samples=False)
    hidden = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    compute_logits = lambda rows: rows @ weight.T  # noqa: E731
    prompt_logprobs.score_prompts(compute_logits, hidden, [(0, chunk)])  # warm-up
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keep the GPU busy: a host that waited for it would find it idle
    scores = prompt_logprobs.score_prompts(compute_logits, hidden, [(0, chunk)])
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert scores.logprobs.shape == (300,) and scores.top_token_ids.shape == (300, 5)
    assert scores.chunks[0].first_position == 100 and scores.tails[0][1].shape == (1, 151936)
