"""Token masks, logit_bias and the min_tokens ban in the sampler (worker_service/sampling/logit_edits.py
and token_masks.py): decoded and validated, applied before every sampling path and to each rank's
slice of the vocabulary, the caller's logits and the returned log-probabilities left raw."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.sampling.sampler import Sampler, SamplerOutput, apply_penalties
from worker_service.sampling.sampling_state import SamplingBatch, SamplingRows
from worker_service.sampling.token_masks import decode_token_mask
from worker_service.sampling.vocab_parallel import VocabSlice, pick_best

P = SamplingParams
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device(request.param)


def allowed_ids(*ids: int) -> worker_pb2.TokenMask:
    return worker_pb2.TokenMask(allowed_ids=worker_pb2.TokenIdList(ids=ids))


def forbidden_ids(*ids: int) -> worker_pb2.TokenMask:
    return worker_pb2.TokenMask(forbidden_ids=worker_pb2.TokenIdList(ids=ids))


def bitmask(allowed: Sequence[int], vocab_size: int) -> worker_pb2.TokenMask:
    bits = np.zeros(vocab_size, dtype=bool)
    bits[list(allowed)] = True
    return worker_pb2.TokenMask(allowed_bitmask=np.packbits(bits, bitorder="little").tobytes())


def build(params: Sequence[SamplingParams], vocab_size: int, device: torch.device, *,
          masks: Sequence[worker_pb2.TokenMask | None] = (), banned: Sequence[Sequence[int]] = (),
          output_index: Sequence[int] | None = None, prompts: Sequence[Sequence[int]] | None = None) -> SamplingBatch:
    n = len(params)
    token_masks = [None if m is None else decode_token_mask(m, vocab_size) for m in masks]
    return SamplingBatch.build(SamplingRows(
        params, prompts if prompts is not None else [None] * n, [[] for _ in range(n)],
        output_index if output_index is not None else [0] * n, token_masks=token_masks,
        min_tokens_banned_ids=banned), vocab_size, device)


# --- decoding ---------------------------------------------------------------------------------


def test_the_three_forms_decode_to_the_same_bits() -> None:
    vocab_size = 13
    expected = decode_token_mask(bitmask([0, 5, 12], vocab_size), vocab_size)
    assert np.unpackbits(expected, bitorder="little")[:vocab_size].nonzero()[0].tolist() == [0, 5, 12]
    assert np.array_equal(decode_token_mask(allowed_ids(12, 5, 0, 5), vocab_size), expected)
    others = [t for t in range(vocab_size) if t not in (0, 5, 12)]
    assert np.array_equal(decode_token_mask(forbidden_ids(*others), vocab_size), expected)
    # Bits past the vocabulary (here 13..15) are padding: cleared, never a token.
    padded = worker_pb2.TokenMask(allowed_bitmask=bytes([0b00100001, 0b11110000]))
    assert np.array_equal(decode_token_mask(padded, vocab_size), expected)
    # A shorter bitmask forbids the tokens past its end.
    short = decode_token_mask(worker_pb2.TokenMask(allowed_bitmask=bytes([0b00100001])), vocab_size)
    assert np.unpackbits(short, bitorder="little")[:vocab_size].nonzero()[0].tolist() == [0, 5]


@pytest.mark.parametrize(("mask", "message"), [
    (worker_pb2.TokenMask(), r"^token_mask: no form set"),
    (worker_pb2.TokenMask(allowed_bitmask=b"\x01\x00\x00"), r"^token_mask\.allowed_bitmask: must be 1..2 bytes "
                                                            r"for a vocabulary of 13, got 3$"),
    (worker_pb2.TokenMask(allowed_bitmask=b"\x00\xe0"), r"^token_mask\.allowed_bitmask: allows no token$"),
    (allowed_ids(3, 13), r"^token_mask\.allowed_ids: ids must be in \[0, 13\), got 13$"),
    (forbidden_ids(-1), r"^token_mask\.forbidden_ids: ids must be in \[0, 13\), got -1$"),
    (allowed_ids(), r"^token_mask\.allowed_ids: allows no token$"),
    (forbidden_ids(*range(13)), r"^token_mask\.forbidden_ids: allows no token$"),
], ids=["no_form", "long_bitmask", "empty_bitmask", "id_too_large", "negative_id", "no_ids", "all_forbidden"])
def test_malformed_masks_name_the_field(mask: worker_pb2.TokenMask, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_token_mask(mask, 13)


# --- masks ------------------------------------------------------------------------------------


def test_masks_hold_on_every_path_and_leave_the_rest_alone(device: torch.device) -> None:
    """Each row's mask allows a few unlikely tokens: greedy takes the best of them, sampled rows
    (temperature, top-k, top-p, min-p, seeded, penalised) only draw among them; the unmasked row and
    the log-probabilities see the raw logits, and the caller's logits are not modified."""
    vocab_size = 300
    logits = torch.randn(8, vocab_size, generator=torch.Generator().manual_seed(3)).to(device) * 3
    allowed = [[7, 100, 299], [1, 2, 3, 4], [250], [10, 20, 30], [5, 6], [40, 41, 42], [8, 9], None]
    masks = [None if ids is None else (allowed_ids(*ids) if row % 2 else bitmask(ids, vocab_size))
             for row, ids in enumerate(allowed)]
    params = [P(temperature=0.0, logprobs=True, num_top_logprobs=3), P(top_k=2), P(top_p=0.5), P(min_p=0.2),
              P(seed=5), P(temperature=0.0, repetition_penalty=1.5), P(temperature=2.0, frequency_penalty=1.0),
              P(temperature=0.0)]
    original = logits.clone()
    sampler = Sampler()
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(40):
        batch = build(params, vocab_size, device, masks=masks, prompts=[[7, 5]] * 8)
        out = sampler.sample(logits, batch)
        for row, token in enumerate(out.token_ids.tolist()):
            seen[row].add(token)
    assert torch.equal(logits, original)
    for row, ids in enumerate(allowed[:-1]):
        assert seen[row] <= set(ids), (row, seen[row])
    best_allowed = int(torch.tensor(allowed[0])[logits[0, allowed[0]].argmax()])
    assert seen[0] == {best_allowed}
    assert seen[7] == {int(logits[7].argmax())}
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.logprobs[0], raw[0, best_allowed])
    assert torch.equal(out.top_token_ids[0], raw[0].topk(3).indices)


def test_a_mask_keeps_the_fused_eligible_batch_plain() -> None:
    """Edits are applied before any sampling path: they do not route a batch off the fused kernel."""
    batch = build([P(temperature=0.7), P(temperature=0.0)], 20, torch.device("cpu"),
                  masks=[allowed_ids(1), None])
    assert batch.is_plain_temperature and batch.logit_edits is not None


# --- logit_bias -------------------------------------------------------------------------------


def test_logit_bias_is_added_after_the_penalties(device: torch.device) -> None:
    """The edited logits equal HF's repetition penalty plus the bias, exactly; +100 makes greedy pick
    the token, -100 on the argmax makes it pick the runner-up."""
    vocab_size = 50
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(1)).to(device)
    top_two = logits[2].topk(2).indices.tolist()
    params = [P(temperature=0.0, logit_bias=[(3, 100.0), (9, -2.5)]),
              P(temperature=0.0, repetition_penalty=1.3, logit_bias=[(4, 0.75)]),
              P(temperature=0.0, logit_bias=[(top_two[0], -100.0)])]
    batch = build(params, vocab_size, device, prompts=[[1], [4, 8], [1]])
    edited = batch.logit_edits.apply(apply_penalties(logits, batch))
    reference = logits.clone()
    reference[1:2] = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[4, 8]], device=device), logits[1:2].clone())
    reference[0, 3] += 100.0
    reference[0, 9] += -2.5
    reference[1, 4] += 0.75
    reference[2, top_two[0]] += -100.0
    assert torch.equal(edited, reference)
    assert Sampler().sample(logits, batch).token_ids.tolist() == [3, int(reference[1].argmax()), top_two[1]]


# --- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_bans_exactly_until_the_index(device: torch.device) -> None:
    """EOS (token 0) is every row's argmax, even through a -5 bias; min_tokens = 3 bans it at output
    indices 0, 1 and 2 and no longer at 3; a ban overrides a bias, and the other stop id is banned too."""
    vocab_size = 20
    logits = torch.zeros(4, vocab_size, device=device)
    logits[:, 0], logits[:, 5], logits[:, 6] = 10.0, 2.0, 3.0
    params = [P(temperature=0.0, min_tokens=3, logit_bias=[(0, -5.0), (5, 0.5)])] * 4
    batch = build(params, vocab_size, device, banned=[[0, 6]] * 4, output_index=[0, 1, 2, 3])
    assert Sampler().sample(logits, batch).token_ids.tolist() == [5, 5, 5, 0]
    sampled = [P(min_tokens=3)] * 4
    for _ in range(20):
        out = Sampler().sample(logits, build(sampled, vocab_size, device, banned=[[0, 6]] * 4,
                                              output_index=[0, 1, 2, 3])).token_ids.tolist()
        assert 0 not in out[:3] and 6 not in out[:3]


def test_a_mask_wins_over_a_ban_that_would_leave_no_token(device: torch.device) -> None:
    """A grammar that allows only EOS must be able to end, min_tokens or not."""
    vocab_size = 20
    logits = torch.zeros(2, vocab_size, device=device)
    params = [P(temperature=0.0, min_tokens=5)] * 2
    batch = build(params, vocab_size, device, masks=[allowed_ids(0), allowed_ids(0, 3)], banned=[[0]] * 2)
    assert Sampler().sample(logits, batch).token_ids.tolist() == [0, 3]


# --- tensor parallelism: each rank's slice ----------------------------------------------------


def slice_tokens(sampler_of: callable, logits: torch.Tensor, batch: SamplingBatch, bounds: list[int],
                 padding: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Sampler.sample_slices on each slice of the vocabulary (the last one followed by padding columns
    that would win if read), the ranks' exchange of bests done here: the group's tokens."""
    pairs = []
    monkeypatch.setattr("worker_service.sampling.sampler.best_of_slices",
                        lambda values, ids: pairs.append(torch.stack([values, ids.float()], dim=1)) or ids)
    vocab_size, width = bounds[-1], max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)) + padding
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        local = torch.full((logits.shape[0], width), 1e4, device=logits.device)
        local[:, :end - start] = logits[:, start:end]
        sampler_of().sample_slices(local, batch, VocabSlice(start, end - start, vocab_size))
    return pick_best(torch.stack(pairs))


def test_slices_apply_their_part_of_the_edits(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rows under tensor parallelism: masks, biases and bans reach each rank's own columns only,
    and the group picks sample()'s tokens from the whole rows."""
    vocab_size = 61
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(8)).to(device)
    params = [P(temperature=0.0), P(temperature=0.0, logit_bias=[(60, 100.0)]),
              P(temperature=0.0, min_tokens=1, logit_bias=[(33, 50.0)]), P(temperature=0.0)]
    masks = [allowed_ids(2, 45, 59), None, None, bitmask([30, 31, 33, 50], vocab_size)]
    batch = build(params, vocab_size, device, masks=masks, banned=[[], [], [33], [50]])
    expected = Sampler().sample(logits, batch).token_ids
    assert expected[1] == 60 and expected[2] != 33 and expected[3] in (30, 31, 33)
    for bounds in ([0, 31, 61], [0, 20, 40, 61], [0, 5, 61]):
        assert torch.equal(slice_tokens(Sampler, logits, batch, bounds, 3, monkeypatch), expected), bounds


def test_unedited_batches_have_no_edits() -> None:
    batch = build([P(), P(temperature=0.0, min_tokens=0)], 10, torch.device("cpu"), banned=[[1], [1]])
    assert batch.logit_edits is None
    assert isinstance(Sampler().sample(torch.zeros(2, 10), batch), SamplerOutput)


@pytest.mark.gpu
def test_cuda_edits_have_no_host_sync() -> None:
    """Laying out and applying masks, biases and bans never waits for the GPU, on the torch path
    (filters, seeds, logprobs) and the greedy one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device, vocab_size = torch.device("cuda"), 151936
    logits = torch.randn(4, vocab_size, device=device, dtype=torch.bfloat16)
    params = [P(top_k=5, seed=3, logit_bias=[(7, 2.0)], min_tokens=2), P(temperature=0.0, logprobs=True),
              P(top_p=0.9), P(temperature=0.0, logit_bias=[(9, -1.0)])]
    masks = [None, bitmask(range(0, vocab_size, 3), vocab_size), allowed_ids(1, 2, 3), forbidden_ids(5)]

    def step() -> SamplerOutput:
        batch = build(params, vocab_size, device, masks=masks, banned=[[0]] * 4)
        return Sampler().sample(logits, batch)

    step()  # warm-up
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keep the GPU busy: a host that waited for it would find it idle
    out = step()
    assert not torch.cuda.current_stream().query(), "the host waited for the GPU"
    torch.cuda.synchronize()
    assert out.token_ids[2] in (1, 2, 3) and out.token_ids[1] % 3 == 0
