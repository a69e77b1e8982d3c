"""Tests of the batched sampler against HF's logits processors and direct references."""
from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.contract.sampling_params import SamplingParams
from worker_service.sampling.sampler import Sampler, apply_penalties, seeded_exponential_noise
from worker_service.sampling.sampling_state import SamplingBatch, SamplingRows, generator_seed
from worker_service.sampling.vocab_parallel import VocabSlice, argmax_of_slice, pick_best

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

P = SamplingParams


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)


def build(
    params: Sequence[SamplingParams],
    vocab_size: int,
    device: torch.device,
    prompts: Sequence[Sequence[int] | None] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    output_index: Sequence[int] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(SamplingRows(
        params,
        prompts if prompts is not None else [None] * n,
        outputs if outputs is not None else [[] for _ in range(n)],
        output_index if output_index is not None else [0] * n,
    ), vocab_size, device)


def hf_filtered(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The row's logits after HF's warpers in generate's order, with the batch's parameters."""
    scores = logits_row[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.int64, device=scores.device)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


# --- greedy and penalties ---------------------------------------------------------------------


def test_greedy_equals_argmax_with_lowest_id_on_ties(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device)
    logits[2, [7, 11, 30]] = 100.0  # a three-way tie: the lowest id wins
    batch = build([P(temperature=0.0)] * 6, 50, device)
    out = Sampler().sample(logits, batch)
    assert batch.is_all_greedy and batch.temperatures is None and batch.top_k is None
    assert batch.seen_token_mask is None and batch.output_token_counts is None
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[2].item() == 7
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_repetition_penalty_matches_hf(device: torch.device) -> None:
    torch.manual_seed(1)
    vocab_size = 64
    logits = torch.randn(4, vocab_size, device=device) * 3
    prompts = [[3, 5, 5, 9], [1, 2], [60, 61], [0, 7, 7]]
    outputs = [[9, 12], [40, 2, 2], [], [63, 80]]  # 80 is outside the vocabulary: ignored, as in HF
    for row, tokens in enumerate(prompts):
        logits[row, tokens[0]] = 10.0  # a seen token on top: the penalty must be able to move it
        logits[row, tokens[-1]] = -2.0
    penalties = [1.3, 0.7, 2.0, 1.0]
    params = [P(temperature=0.0, repetition_penalty=r) for r in penalties]
    batch = build(params, vocab_size, device, prompts, outputs)

    expected = torch.stack([
        RepetitionPenaltyLogitsProcessor(r)(
            torch.tensor([[t for t in prompt + output if t < vocab_size]], device=device), logits[row : row + 1].clone()
        )[0]
        for row, (r, prompt, output) in enumerate(zip(penalties, prompts, outputs, strict=True))
    ])
    if device.type == "cpu":
        assert torch.equal(apply_penalties(logits, batch), expected)
    else:  # CUDA divides by a Python scalar as a multiply by its reciprocal: HF is 1 ulp off a true division
        torch.testing.assert_close(apply_penalties(logits, batch), expected, rtol=1.2e-7, atol=0.0)
    assert torch.equal(Sampler().sample(logits, batch).token_ids, expected.argmax(dim=-1))
    assert not torch.equal(expected.argmax(dim=-1), logits.argmax(dim=-1))  # the test means something


def test_frequency_and_presence_penalties_match_reference(device: torch.device) -> None:
    vocab_size = 16
    # Dyadic values, so float32 arithmetic is exact and the comparison can be too.
    logits = torch.arange(vocab_size * 3, dtype=torch.float32, device=device).reshape(3, vocab_size) / 8 - 2
    outputs = [[1, 1, 1, 4, 15], [2, 3], [5, 5]]
    prompts = [None, None, [5, 6, 6]]  # only the repetition penalty reads the prompt
    params = [
        P(frequency_penalty=0.5, presence_penalty=0.25),
        P(temperature=0.0),
        P(temperature=0.0, frequency_penalty=-1.5, presence_penalty=1.0, repetition_penalty=2.0),
    ]
    batch = build(params, vocab_size, device, prompts, outputs)

    expected = logits.cpu().tolist()
    for row, p in enumerate(params):
        seen = set(outputs[row]) | set(prompts[row] or [])
        for token in range(vocab_size):
            value = expected[row][token]
            if p.repetition_penalty != 1.0 and token in seen:
                value = value * p.repetition_penalty if value < 0 else value / p.repetition_penalty
            count = outputs[row].count(token)
            if p.frequency_penalty or p.presence_penalty:
                value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            expected[row][token] = value
    assert torch.equal(apply_penalties(logits, batch).cpu(), torch.tensor(expected))
    assert torch.equal(batch.output_token_counts[1], torch.zeros(vocab_size, device=device))  # neutral row: skipped


def test_penalties_are_skipped_when_neutral_and_prompt_required_otherwise() -> None:
    batch = build([P(), P(temperature=0.0)], 8, torch.device("cpu"))
    assert batch.seen_token_mask is None and batch.output_token_counts is None
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None and not batch.seeded_rows
    logits = torch.randn(2, 8)
    assert apply_penalties(logits, batch) is logits
    with pytest.raises(ValueError, match="prompt"):
        build([P(repetition_penalty=1.1)], 8, torch.device("cpu"), prompts=[None])
    with pytest.raises(ValueError):
        P(top_p=0.0)
    assert P(temperature=1e-7).is_greedy and not P(temperature=1e-3).is_greedy


# --- filters and the sampled distribution -------------------------------------------------------

FILTER_GROUPS = {
    "top_k_only": [P(top_k=5), P(temperature=0.8), P(top_k=1)],
    "top_k_and_top_p": [P(top_p=0.6), P(top_k=8, top_p=0.9, temperature=1.5), P(top_k=3), P(temperature=0.0)],
    "min_p": [P(min_p=0.1), P(min_p=0.3, temperature=0.7)],
    "all_filters": [P(top_k=10, top_p=0.8, min_p=0.05, temperature=1.3), P(top_p=0.95, min_p=0.2)],
}


@pytest.mark.parametrize("group", list(FILTER_GROUPS))
def test_filters_allowed_set_and_distribution(group: str, device: torch.device) -> None:
    vocab_size, num_draws = 40, 2000
    generator = torch.Generator().manual_seed(2)
    row_logits = (torch.randperm(vocab_size, generator=generator).float() * -0.12).to(device)
    kinds = FILTER_GROUPS[group]
    params = [kinds[i % len(kinds)] for i in range(num_draws * len(kinds))]
    torch.manual_seed(3)
    batch = build(params, vocab_size, device)
    tokens = Sampler().sample(row_logits.expand(len(params), -1).contiguous(), batch).token_ids.cpu()

    for k, p in enumerate(kinds):
        drawn = tokens[k :: len(kinds)]
        if p.is_greedy:
            assert torch.all(drawn == row_logits.argmax().item())
            continue
        reference = hf_filtered(row_logits, p).double().cpu()
        _assert_not_near_top_p_boundary(row_logits.double().cpu() / p.temperature, p)
        allowed = torch.isfinite(reference)
        assert allowed[drawn].all(), f"{p}: sampled a filtered token"
        expected = torch.softmax(reference, dim=-1)
        observed = torch.bincount(drawn, minlength=vocab_size).double() / num_draws
        assert (observed[expected > 0.02] > 0).all(), f"{p}: a likely token never came up"
        chi2 = (num_draws * (observed - expected)[allowed] ** 2 / expected[allowed]).sum().item()
        dof = max(int(allowed.sum()) - 1, 1)
        assert chi2 < dof + 6 * math.sqrt(2 * dof), f"{p}: chi-square {chi2:.1f} for {dof} degrees of freedom"


def _assert_not_near_top_p_boundary(scaled_logits: torch.Tensor, p: SamplingParams) -> None:
    """Guards the test itself: a float tie at the top-p cut would make the allowed set ambiguous."""
    if p.top_p >= 1.0:
        return
    ordered = scaled_logits.sort(descending=True).values
    if p.top_k > 0:
        ordered = ordered[: p.top_k]
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    assert (cumulative - p.top_p).abs().min() > 1e-3


# --- seeds ----------------------------------------------------------------------------------------


def test_seeded_token_is_independent_of_batch_and_position(device: torch.device) -> None:
    vocab_size = 1000
    generator = torch.Generator().manual_seed(4)
    others = (torch.randn(7, vocab_size, generator=generator) * 0.5).to(device)
    other_params = [
        P(temperature=0.0),
        P(seed=99),
        P(),
        P(top_k=4, seed=7),
        P(temperature=0.5, repetition_penalty=1.2),
        P(min_p=0.5, seed=1),
        P(top_p=0.3),
    ]
    sampler = Sampler()
    for case in range(12):
        row = (torch.randn(vocab_size, generator=generator) * 0.5).to(device)
        p = P(temperature=0.9, top_p=0.95, seed=1234 + case * (1 << 40))
        index = 3 * case
        torch.manual_seed(case)
        alone = sampler.sample(row[None], build([p], vocab_size, device, output_index=[index])).token_ids
        position = case % 8
        logits = torch.cat([others[:position], row[None], others[position:]])
        params = other_params[:position] + [p] + other_params[position:]
        prompts = [[1, 2]] * 8
        torch.manual_seed(1000 + case)  # the global generator must not matter
        output_index = [index + 1 + i for i in range(8)]
        output_index[position] = index
        batch = build(params, vocab_size, device, prompts, [[5]] * 8, output_index)
        mixed = sampler.sample(logits, batch).token_ids
        assert mixed[position] == alone[0]

        noise = seeded_exponential_noise(generator_seed(p.seed, index), vocab_size, device)
        probs = torch.softmax(hf_filtered(row, p), dim=-1)
        assert alone[0] == (probs / noise).argmax()  # the seeded noise is really the one used


def test_output_index_and_seed_change_the_noise(device: torch.device) -> None:
    vocab_size = 500
    seeds = {generator_seed(s, n) for s in (0, 1, 1 << 32, (1 << 64) - 1) for n in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 1 << 63 for s in seeds)
    # Seeds that differ only in their high 32 bits still differ where mt19937 looks (the low 32).
    assert generator_seed(5, 0) & 0xFFFFFFFF != generator_seed(5 + (1 << 32), 0) & 0xFFFFFFFF
    first = seeded_exponential_noise(generator_seed(42, 0), vocab_size, device)
    assert torch.equal(first, seeded_exponential_noise(generator_seed(42, 0), vocab_size, device))
    assert not torch.equal(first, seeded_exponential_noise(generator_seed(42, 1), vocab_size, device))
    assert not torch.equal(first, seeded_exponential_noise(generator_seed(43, 0), vocab_size, device))

    logits = torch.zeros(1, vocab_size, device=device)  # uniform: the token is the noise's argmin
    tokens = {
        Sampler().sample(logits, build([P(seed=42)], vocab_size, device, output_index=[n])).token_ids.item()
        for n in range(20)
    }
    assert len(tokens) > 10


# --- log-probabilities ------------------------------------------------------------------------------


def test_logprobs_are_raw_and_top_logprobs_sorted(device: torch.device) -> None:
    torch.manual_seed(5)
    vocab_size = 300
    logits = torch.randn(5, vocab_size, device=device) * 2
    params = [
        P(temperature=0.0, logprobs=True, repetition_penalty=1.5),
        P(temperature=0.7, top_k=20, logprobs=True, num_top_logprobs=3),
        P(temperature=1.2, frequency_penalty=1.0, logprobs=True, num_top_logprobs=5),
        P(temperature=0.9),  # no logprobs asked for (top logprobs alone are invalid: SamplingParams)
        P(temperature=0.0),
    ]
    batch = build(params, vocab_size, device, [[1, 2, 3]] * 5, [[4, 4, 2]] * 5)
    out = Sampler().sample(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == (5, 5) and out.top_token_ids.shape == (5, 5)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    reference = raw.sort(dim=-1, descending=True)
    assert torch.equal(out.top_token_ids, reference.indices[:, :5])
    assert torch.equal(out.top_logprobs, reference.values[:, :5])
    assert torch.equal(out.top_logprobs, raw.gather(1, out.top_token_ids))


def test_bf16_logits_are_left_untouched(device: torch.device) -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, 100, device=device).to(torch.bfloat16)
    before = logits.clone()
    params = [P(logprobs=True, num_top_logprobs=2, top_p=0.5), P(temperature=0.0), P(presence_penalty=1.0)]
    out = Sampler().sample(logits, build(params, 100, device, outputs=[[1], [2], [3]]))
    assert torch.equal(logits, before)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, torch.log_softmax(logits.float(), dim=-1).gather(1, out.token_ids[:, None])[:, 0])
    assert out.token_ids[1] == logits[1].argmax()


# --- mixed batches ----------------------------------------------------------------------------------


def test_mixed_batch_rows_follow_their_own_params(device: torch.device) -> None:
    vocab_size = 32
    logits = torch.full((4, vocab_size), -5.0, device=device)
    logits[:, 10] = 3.0
    logits[:, 20] = 2.9  # two near-equal candidates
    logits[2, 10] = 2.8  # row 2 is greedy with a repetition penalty that turns 20 into 10
    params = [
        P(temperature=0.0),
        P(top_k=2),
        P(temperature=0.0, repetition_penalty=1.2),
        P(top_k=2, temperature=2.0),
    ]
    prompts = [[1], [1], [20], [1]]
    counts = torch.zeros(4, vocab_size, dtype=torch.int64)
    sampler = Sampler()
    torch.manual_seed(7)
    for _ in range(100):
        tokens = sampler.sample(logits, build(params, vocab_size, device, prompts)).token_ids.cpu()
        counts[torch.arange(4), tokens] += 1
    assert counts[0, 10] == 100 and counts[2, 10] == 100
    for row in (1, 3):
        assert counts[row, 10] + counts[row, 20] == 100 and counts[row, 10] > 20 and counts[row, 20] > 20


@pytest.mark.gpu
def test_cuda_step_has_no_host_sync() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    logits = torch.randn(6, 1000, device=device)
    params = [
        P(temperature=0.0, repetition_penalty=1.1),
        P(top_k=5, seed=3),
        P(top_p=0.9, frequency_penalty=0.5, presence_penalty=0.5, logprobs=True, num_top_logprobs=4),
        P(min_p=0.1),
        P(top_k=50, top_p=0.7, min_p=0.01, seed=9),
        P(),
    ]
    sampler = Sampler()
    sampler.sample(logits, build(params, 1000, device, [[1, 2]] * 6, [[3, 3]] * 6))  # warm-up
    torch.cuda.synchronize()
    # Keep the GPU busy for a while: if building or sampling waited for it, it would be idle after.
    torch.cuda._sleep(2_000_000_000)
    out = sampler.sample(logits, build(params, 1000, device, [[1, 2]] * 6, [[3, 3]] * 6))
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert out.token_ids.shape == (6,) and out.top_logprobs.shape == (6, 4)


def test_greedy_rows_from_slices_of_the_vocabulary(device: torch.device) -> None:
    """Tensor parallelism's greedy path (vocab_parallel): each slice's argmax, the best of them kept,
    is the whole row's argmax; a maximum in two slices goes to the lower id, and the padding columns
    after the last slice are never read."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)).to(device)
    logits[0, [7, 40]] = 9.0
    slices = [VocabSlice(0, 20, 50), VocabSlice(20, 20, 50), VocabSlice(40, 10, 50)]
    pairs = []
    for vocab_slice in slices:
        local = logits[:, vocab_slice.start:vocab_slice.start + vocab_slice.size]
        local = torch.cat([local, torch.full((4, 20 - vocab_slice.size), 99.0, device=device)], dim=1)
        values, token_ids = argmax_of_slice(local, vocab_slice)
        pairs.append(torch.stack([values, token_ids.float()], dim=1))
    assert torch.equal(pick_best(torch.stack(pairs)), logits.argmax(dim=-1))
    assert logits.argmax(dim=-1)[0] == 7
    with pytest.raises(ValueError, match="no token"):  # 5 tokens over 4 ranks: 2, 2, 1, none
        VocabSlice(6, 5 - 6, 5)


def test_which_batches_sample_from_slices() -> None:
    """Greedy and plain-temperature batches (the latter where the fused kernel runs) sample from the
    slices; any filter, penalty, seed or log-probability needs the whole rows."""
    sampler, cpu, cuda = Sampler(), torch.device("cpu"), torch.device("cuda")
    assert sampler.samples_slices(build([P(temperature=0)] * 2, 10, cpu), torch.float32, cpu)
    assert sampler.samples_slices(build([P(temperature=0.7), P(temperature=0)], 10, cpu), torch.bfloat16, cuda)
    assert not sampler.samples_slices(build([P(temperature=0.7)], 10, cpu), torch.float32, cpu)  # no kernel on CPU
    for other in (P(top_k=5), P(top_p=0.9), P(min_p=0.1), P(repetition_penalty=1.2), P(seed=3), P(logprobs=2)):
        assert not sampler.samples_slices(build([other], 10, cpu, prompts=[[1]]), torch.bfloat16, cuda), other
