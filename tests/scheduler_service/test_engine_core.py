"""EngineCore.process_step on replies of several decode iterations: one update per sequence, tokens
after the one that ends a sequence dropped, a sequence's tokens joined when a reply splits them; steps
of decodes alone timed, and their time per iteration sizing the next ones."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from common.contract.config import SchedulerConfig
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.core import step_loop
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.scheduler import MIN_DECODE_PERIODS
from scheduler_service.core.sequence import FinishReason, Sequence
from scheduler_service.core.step_builder import InFlightStep
from scheduler_service.core.step_loop import drive

INFO = WorkerDescription(model_name="fake", dtype="fake", block_size=16, max_model_len=256, vocab_size=100,
                         num_kv_blocks=64, device="fake", eos_token_ids=(99,))


def attached(config: SchedulerConfig) -> EngineCore:
    core = EngineCore(config)
    core.attach(INFO, INFO.num_kv_blocks)
    return core


def reply(step: InFlightStep, tokens: list[tuple[int, int]]) -> worker_pb2.StepResponse:
    response = worker_pb2.StepResponse(step_id=step.step_id)
    for seq_id, token_id in tokens:
        response.tokens.add(seq_id=seq_id, token_id=token_id, logprob=-0.5)
    return response


def decoding(core: EngineCore, *params: SamplingParams) -> tuple[list[Sequence], InFlightStep]:
    """Sequences past their prefill (first token 1) and the step of 4 decode iterations after it."""
    sequences = [core.add_request([5, 6, 7], p) for p in params]
    prefill = core.build_step()
    decode = core.build_step()  # launched before the prefill's reply, as drive() does
    core.process_step(prefill, reply(prefill, [(seq.seq_id, 1) for seq in sequences]))
    assert decode.request.num_decode_steps == 4
    return sequences, decode


def test_a_stop_token_drops_the_tokens_after_it_and_others_keep_theirs() -> None:
    core = attached(SchedulerConfig(num_decode_steps=4))
    (stopping, other), step = decoding(core, SamplingParams(max_tokens=50, stop_token_ids=[42], logprobs=True),
                                       SamplingParams(max_tokens=50))
    updates = core.process_step(step, reply(step, [(stopping.seq_id, t) for t in (3, 42, 4, 5)]
                                            + [(other.seq_id, t) for t in (8, 9, 10, 11)]))
    assert [(u.seq_id, u.token_ids, u.finished) for u in updates] == [(stopping.seq_id, [3, 42], True),
                                                                      (other.seq_id, [8, 9, 10, 11], False)]
    assert updates[0].logprobs == [-0.5, -0.5] and updates[1].logprobs == []
    assert (stopping.finish_reason, stopping.matched_stop) == (FinishReason.STOP, 42)
    assert stopping.output_token_ids == [1, 3, 42] and other.output_token_ids == [1, 8, 9, 10, 11]
    assert other.num_pending_tokens == 0


def test_max_tokens_and_eos_end_a_sequence_mid_step() -> None:
    core = attached(SchedulerConfig(num_decode_steps=4))
    (short, eos), step = decoding(core, SamplingParams(max_tokens=3), SamplingParams(max_tokens=50))
    updates = core.process_step(step, reply(step, [(short.seq_id, t) for t in (2, 3, 4, 5)]
                                            + [(eos.seq_id, t) for t in (7, 99, 8, 9)]))
    assert [(u.token_ids, u.finished) for u in updates] == [([2, 3], True), ([7, 99], True)]
    assert short.finish_reason is FinishReason.LENGTH and short.num_output_tokens == 3
    assert eos.finish_reason is FinishReason.STOP and eos.matched_stop is None


def test_a_sequences_tokens_split_over_a_reply_make_one_update() -> None:
    core = attached(SchedulerConfig(num_decode_steps=4))
    (first, second), step = decoding(core, SamplingParams(max_tokens=50), SamplingParams(max_tokens=50))
    updates = core.process_step(step, reply(step, [(first.seq_id, 2), (first.seq_id, 3), (second.seq_id, 4),
                                                   (first.seq_id, 5), (first.seq_id, 6)]))
    assert [(u.seq_id, u.token_ids) for u in updates] == [(first.seq_id, [2, 3, 5, 6]), (second.seq_id, [4])]
    assert first.output_token_ids == [1, 2, 3, 5, 6]


def test_decode_only_steps_are_timed_and_a_lone_sequences_short_iterations_lengthen_its_steps() -> None:
    core = attached(SchedulerConfig(num_decode_steps=4, decode_step_ms=8.0))
    sequences, decode = decoding(core, SamplingParams(max_tokens=200))
    assert decode.num_decode_steps == 4
    for _ in range(MIN_DECODE_PERIODS):
        core.observe_period(decode, 0.002)  # 4 iterations in 2 ms
    assert core.build_step().request.num_decode_steps == 16


def test_a_step_with_a_prefill_is_not_timed() -> None:
    core = attached(SchedulerConfig(num_decode_steps=4, decode_step_ms=8.0))
    core.add_request([5, 6, 7], SamplingParams(max_tokens=200))
    prefill = core.build_step()
    assert prefill.num_decode_steps == 0
    for _ in range(MIN_DECODE_PERIODS):
        core.observe_period(prefill, 0.0001)
    core.process_step(prefill, reply(prefill, [(seq_id, 1) for seq_id in prefill.scheduled]))
    assert core.build_step().request.num_decode_steps == 4


def test_drive_times_each_step_from_the_previous_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps whose replies come 0.5 ms per decode iteration apart (a fake clock): steps of decodes
    keep num_decode_steps until MIN_DECODE_PERIODS of them are timed (the step after the prefill has
    no period: nothing came before it; each step is built before its predecessor's reply), then
    8 ms hold 16 iterations."""
    clock = [0.0]
    monkeypatch.setattr(step_loop.time, "perf_counter", lambda: clock[0])
    core = attached(SchedulerConfig(num_decode_steps=4, decode_step_ms=8.0))
    core.add_request([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    sent: list[int] = []

    async def answer(step: InFlightStep) -> worker_pb2.StepResponse:
        iterations = max(step.request.num_decode_steps, 1)
        clock[0] += iterations * 0.0005
        return reply(step, [(seq_id, 1) for seq_id in step.scheduled for _ in range(iterations)])

    def launch(step: InFlightStep, ahead: InFlightStep | None) -> Awaitable[worker_pb2.StepResponse]:
        sent.append(step.request.num_decode_steps)
        return answer(step)

    asyncio.run(drive(core, launch, lambda step, updates, period_s: None))
    assert sent[:MIN_DECODE_PERIODS + 3] == [1, *[4] * (MIN_DECODE_PERIODS + 1), 16]
