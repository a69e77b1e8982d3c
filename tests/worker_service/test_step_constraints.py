"""Token masks, logit_bias and min_tokens through a whole worker step (a tiny random Qwen3 on the CPU,
float32): greedy tokens are the reference model's argmax over what is allowed, sampled and seeded
tokens stay inside the mask, min_tokens holds EOS back exactly until its index, in multi-iteration
decode steps too; malformed steps are ValueErrors naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.contract.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.step_driver import DEVICES, Reference, StepDriver, running, tokens_of, worker_config
from tests.worker_service.test_logit_edits import allowed_ids, bitmask, forbidden_ids
from worker_service.runtime.worker import WorkerCore

P = SamplingParams
VOCAB_SIZE = 512
EOS = VOCAB_SIZE - 1  # the tiny checkpoints' eos_token_id
PROMPT = [5, 17, 300, 42, 8, 99, 123, 7, 64, 1, 250, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("constraints"), "qwen3", seed=3)


@pytest.fixture(scope="module")
def reference(model: Path) -> Reference:
    return Reference(model)


@pytest.fixture(params=DEVICES)
def driver(model: Path, request: pytest.FixtureRequest) -> StepDriver:
    return StepDriver(WorkerCore(worker_config(model, request.param)))


def best_allowed(logits: torch.Tensor, allowed: list[int]) -> int:
    return allowed[int(logits[allowed].argmax())]


def test_masked_rows_sample_only_allowed_tokens(driver: StepDriver, reference: Reference) -> None:
    """A prefill and three decode steps, a fresh mask each step: the masked greedy row takes the best
    allowed token of transformers' logits; the sampled, top-k and seeded rows draw inside their masks;
    the unmasked row generates transformers' greedy continuation."""
    allowed = [[[2, 9, 400], [10, 11], [7], [300, 301, 302, 303]][step] for step in range(4)]
    forbidden = list(range(0, VOCAB_SIZE, 2))  # only odd tokens
    masks = {1: lambda s: allowed_ids(*allowed[s]), 2: lambda s: bitmask(allowed[s], VOCAB_SIZE),
             3: lambda s: forbidden_ids(*forbidden), 4: lambda s: bitmask(allowed[s], VOCAB_SIZE)}
    params = {1: P(temperature=0.0), 2: P(temperature=1.0), 3: P(top_k=5, seed=11), 4: P(temperature=0.9, seed=2),
              5: P(temperature=0.0)}
    new = [driver.new(seq_id, PROMPT, p, mask=masks[seq_id](0) if seq_id in masks else None)
           for seq_id, p in params.items()]
    response = driver.step(new)
    outputs = {seq_id: tokens_of(response, seq_id) for seq_id in params}
    for step in range(1, 4):
        response = driver.step(running=[running(seq_id, mask=masks[seq_id](step) if seq_id in masks else None)
                                        for seq_id in params])
        for seq_id in params:
            outputs[seq_id] += tokens_of(response, seq_id)
    for step in range(4):
        logits = reference.logits(PROMPT + outputs[1][:step])[-1]
        assert outputs[1][step] == best_allowed(logits, allowed[step])
        assert outputs[2][step] in allowed[step] and outputs[4][step] in allowed[step]
        assert outputs[3][step] % 2 == 1
    greedy = []
    for _ in range(4):
        greedy.append(int(reference.logits(PROMPT + greedy)[-1].argmax()))
    assert outputs[5] == greedy


def test_logit_bias_changes_the_argmax_as_added(driver: StepDriver, reference: Reference) -> None:
    """+100 on a token makes greedy pick it every step; -3 on others moves the argmax exactly as the
    reference's logits plus the bias do."""
    bias = [(20, -3.0), (77, 2.5), (400, -1.0)]
    response = driver.step([driver.new(1, PROMPT, P(temperature=0.0, logit_bias=[(123, 100.0)])),
                            driver.new(2, PROMPT, P(temperature=0.0, logit_bias=bias))])
    outputs = {seq_id: tokens_of(response, seq_id) for seq_id in (1, 2)}
    for _ in range(3):
        response = driver.step(running=[running(1), running(2)])
        for seq_id in (1, 2):
            outputs[seq_id] += tokens_of(response, seq_id)
    assert outputs[1] == [123] * 4
    expected = []
    for _ in range(4):
        logits = reference.logits(PROMPT + expected)[-1]
        for token, value in bias:
            logits[token] += value
        expected.append(int(logits.argmax()))
    assert outputs[2] == expected


@pytest.mark.parametrize("num_decode_steps", [1, 5])
def test_min_tokens_holds_eos_back_until_its_index(driver: StepDriver, reference: Reference,
                                                   num_decode_steps: int) -> None:
    """EOS biased +100 would win every step; with min_tokens = 4 the tokens at output indices 0..3 are
    the reference's argmax without EOS (nor the other banned id), and index 4 on is EOS. With
    num_decode_steps = 5 the ban lifts inside one multi-iteration step."""
    params = P(temperature=0.0, min_tokens=4, logit_bias=[(EOS, 100.0)])
    sampled = P(temperature=0.8, min_tokens=4, logit_bias=[(EOS, 100.0)])  # unseeded: only min_tokens rebuilds
    response = driver.step([driver.new(1, PROMPT, params, banned=[EOS, 9]),
                            driver.new(2, PROMPT, sampled, banned=[EOS])])
    outputs = {seq_id: tokens_of(response, seq_id) for seq_id in (1, 2)}
    while len(outputs[1]) < 7:
        response = driver.step(running=[running(1), running(2)], num_decode_steps=num_decode_steps)
        for seq_id in (1, 2):
            outputs[seq_id] += tokens_of(response, seq_id)
    expected = []
    for _ in range(4):
        logits = reference.logits(PROMPT + expected)[-1]
        logits[[EOS, 9]] = float("-inf")
        expected.append(int(logits.argmax()))
    assert outputs[1][:7] == expected + [EOS] * 3
    assert EOS not in outputs[2][:4] and outputs[2][4:7] == [EOS] * 3


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.new(1, PROMPT, P(), mask=bitmask([1], 520)),
     r"^sequence 1: token_mask\.allowed_bitmask: must be 1\.\.64 bytes for a vocabulary of 512, got 65$"),
    (lambda d: d.new(1, PROMPT, P(), mask=allowed_ids(512)),
     r"^sequence 1: token_mask\.allowed_ids: ids must be in \[0, 512\), got 512$"),
    (lambda d: d.new(1, PROMPT, P(), mask=forbidden_ids(*range(VOCAB_SIZE))),
     r"^sequence 1: token_mask\.forbidden_ids: allows no token$"),
    (lambda d: d.new(1, PROMPT, P(logit_bias=[(3, 1.0), (600, 1.0)])),
     r"^sequence 1: sampling\.logit_bias: token ids must be in \[0, 512\), got 600$"),
    (lambda d: d.new(1, PROMPT, P(min_tokens=2), banned=[EOS, 512]),
     r"^sequence 1: sampling\.min_tokens_banned_ids: token ids must be in \[0, 512\), got 512$"),
], ids=["bitmask_length", "mask_id", "mask_empty", "bias_id", "banned_id"])
def test_malformed_steps_are_value_errors_naming_the_field(driver: StepDriver, change, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        driver.step([change(driver)])


def test_a_mask_in_a_multi_iteration_step_is_refused(driver: StepDriver) -> None:
    driver.step([driver.new(1, PROMPT, P(temperature=0.0))])
    with pytest.raises(ValueError, match=r"^sequence 1: token_mask: not allowed with num_decode_steps 2"):
        driver.step(running=[running(1, mask=allowed_ids(3))], num_decode_steps=2)


def test_a_mask_on_a_chunk_that_samples_nothing_is_ignored(driver: StepDriver, reference: Reference) -> None:
    """Only the chunk that reaches the prompt's end samples; a mask on an earlier chunk has no effect."""
    driver.step([driver.new(1, PROMPT, P(temperature=0.0), chunk=5, mask=allowed_ids(3))])
    response = driver.step(running=[running(1, PROMPT[5:])])
    assert tokens_of(response, 1) == [int(reference.logits(PROMPT)[-1].argmax())]
