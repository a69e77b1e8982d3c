"""Token masks, logit_bias, min_tokens and prompt logprobs under tensor parallelism (two ranks on the
CPU, gloo): the same steps give one process's tokens exactly, and its logprobs. The vocabulary (509)
does not divide by 2, so the second rank's slice ends in padding columns, which no edit may reach;
a batch with a row asking for logprobs samples from the gathered rows (the first two steps), greedy
batches from each rank's slice, edited there (the rest); prompt logprobs come from gathered blocks of
logits."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2
from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.step_driver import StepDriver, running, worker_config
from tests.worker_service.test_logit_edits import allowed_ids, bitmask
from worker_service.runtime.tp_group import create_worker_core

P = SamplingParams
VOCAB_SIZE = 509
EOS = VOCAB_SIZE - 1
PROMPTS = {1: [3, 250, 17, 400, 5, 66, 7, 8, 300, 10, 11, 12],
           2: [40, 41, 42, 43, 44, 45, 46, 47, 48],
           3: [(7 * i + 3) % VOCAB_SIZE for i in range(40)],
           4: [100, 200, 300, 400, 500, 7]}
# Seq 1's masks: both slices, then only the first rank's tokens, then only the second's (its last
# real ones, next to the padding), the last two in greedy batches that sample from the slices.
MASKS_1 = [allowed_ids(2, 254, 255, 507), bitmask([0, 1, 100], VOCAB_SIZE), allowed_ids(500, 507, 508)]


def scenario(core) -> list[worker_pb2.StepResponse]:
    driver = StepDriver(core)
    params = {1: P(temperature=0.0), 2: P(temperature=0.0, min_tokens=4, logit_bias=[(EOS, 100.0), (3, -1.5)]),
              3: P(temperature=0.0, num_prompt_logprobs=3), 4: P(temperature=0.0, logprobs=True, num_top_logprobs=2)}
    responses = [driver.step([driver.new(1, PROMPTS[1], params[1], mask=MASKS_1[0]),
                              driver.new(2, PROMPTS[2], params[2], banned=[EOS]),
                              driver.new(3, PROMPTS[3], params[3], chunk=16),
                              driver.new(4, PROMPTS[4], params[4], mask=allowed_ids(9, 480))])]
    responses.append(driver.step(running=[running(1, mask=MASKS_1[1]), running(2), running(3, PROMPTS[3][16:32]),
                                          running(4)]))
    # Seq 4 (logprobs) gone: greedy batches, sampled from each rank's slice.
    responses.append(driver.step(running=[running(1, mask=MASKS_1[2]), running(2), running(3, PROMPTS[3][32:])],
                                 released=[4]))
    responses.append(driver.step(running=[running(seq_id) for seq_id in (1, 2, 3)], num_decode_steps=3))
    return responses


def test_two_ranks_step_as_one(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", num_heads=8, num_kv_heads=1, head_dim=16, hidden_size=96,
                                tie=True, vocab_size=VOCAB_SIZE, seed=4)
    results = []
    for size in (1, 2):
        core = create_worker_core(worker_config(path, "cpu", tensor_parallel_size=size))
        try:
            results.append(scenario(core))
        finally:
            core.close()
    one, two = results
    for alone, split in zip(one, two, strict=True):
        assert [(t.seq_id, t.token_id) for t in split.tokens] == [(t.seq_id, t.token_id) for t in alone.tokens]
        for a, b in zip(alone.tokens, split.tokens, strict=True):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t.token_id for t in b.top_logprobs] == [t.token_id for t in a.top_logprobs]
        assert [(e.seq_id, e.first_position, [t.token_id for t in e.tokens]) for e in split.prompt_logprobs] == \
            [(e.seq_id, e.first_position, [t.token_id for t in e.tokens]) for e in alone.prompt_logprobs]
        for a, b in zip(alone.prompt_logprobs, split.prompt_logprobs, strict=True):
            assert [t.logprob for t in b.tokens] == pytest.approx([t.logprob for t in a.tokens], abs=1e-4)
            assert [[x.token_id for x in t.top_logprobs] for t in b.tokens] == \
                [[x.token_id for x in t.top_logprobs] for t in a.tokens]
    by_seq = {seq_id: [t.token_id for r in one for t in r.tokens if t.seq_id == seq_id] for seq_id in PROMPTS}
    assert by_seq[1][0] in (2, 254, 255, 507) and by_seq[1][1] in (0, 1, 100) and by_seq[1][2] in (500, 507, 508)
    assert len(by_seq[4]) == 2 and by_seq[4][0] in (9, 480)
    assert EOS not in by_seq[2][:4] and by_seq[2][4:] == [EOS] * (len(by_seq[2]) - 4)
    assert [e.first_position for r in one for e in r.prompt_logprobs] == [1, 16, 32]
