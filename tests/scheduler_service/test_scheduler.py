"""Scheduler: admission limits, chunked prefill, decode, preemption order."""
from __future__ import annotations

import pytest

from common.contract.config import MAX_DECODE_STEPS, SchedulerConfig
from common.contract.sampling_params import SamplingParams
from scheduler_service.core.block_manager import BlockManager
from scheduler_service.core.scheduler import DECODE_PERIOD_WINDOW, MIN_DECODE_PERIODS, Scheduler, SchedulerOutput
from scheduler_service.core.sequence import FinishReason, Sequence, SequenceStatus

BLOCK = 16


def make(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 1024,
         max_model_len: int = 4096, prefix_caching: bool = True, num_decode_steps: int = 1,
         decode_step_ms: float = 8.0) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=prefix_caching, num_decode_steps=num_decode_steps,
                             decode_step_ms=decode_step_ms)
    return Scheduler(config, BlockManager(num_blocks, BLOCK, prefix_caching), max_model_len)


def add(scheduler: Scheduler, num_tokens: int, first_token: int = 0, max_tokens: int = 100) -> Sequence:
    seq = Sequence(list(range(first_token, first_token + num_tokens)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(seq)
    return seq


def complete(scheduler: Scheduler, output: SchedulerOutput, token: int = 7) -> None:
    """What the engine does with the worker's reply: sampled tokens appended, blocks registered."""
    for item in output.scheduled:
        item.seq.append_tokens([token] * item.num_samples)
        scheduler.block_manager.register_computed_blocks(item.seq)


def planned(output: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(item.seq.seq_id, item.start_position, item.num_tokens) for item in output.scheduled]


def test_fcfs_admission_bounded_by_max_num_seqs() -> None:
    scheduler = make(max_num_seqs=2)
    seqs = [add(scheduler, 10, first_token=100 * i) for i in range(3)]
    output = scheduler.schedule()
    assert planned(output) == [(seqs[0].seq_id, 0, 10), (seqs[1].seq_id, 0, 10)]
    assert all(item.num_samples and item.is_new_on_worker for item in output.scheduled)
    assert list(scheduler.waiting) == [seqs[2]]
    complete(scheduler, output)
    # Next step: two decodes, the third still waits for a free seat.
    output = scheduler.schedule()
    assert planned(output) == [(seqs[0].seq_id, 10, 1), (seqs[1].seq_id, 10, 1)]
    scheduler.finish(seqs[0], FinishReason.LENGTH)
    complete(scheduler, output)
    output = scheduler.schedule()
    assert planned(output) == [(seqs[1].seq_id, 11, 1), (seqs[2].seq_id, 0, 10)]
    assert output.released_seq_ids == [seqs[0].seq_id]


def test_token_budget_chunks_long_prompt() -> None:
    scheduler = make(max_num_batched_tokens=32)
    long = add(scheduler, 80)
    short = add(scheduler, 5, first_token=1000)
    output = scheduler.schedule()
    assert planned(output) == [(long.seq_id, 0, 32)]
    assert not output.scheduled[0].num_samples
    assert long.block_table == [0, 1]  # blocks only for the chunk
    complete(scheduler, output)
    output = scheduler.schedule()
    assert planned(output) == [(long.seq_id, 32, 32)]
    complete(scheduler, output)
    output = scheduler.schedule()
    # The last 16 prompt tokens leave budget for the short prompt in the same step.
    assert planned(output) == [(long.seq_id, 64, 16), (short.seq_id, 0, 5)]
    assert [item.num_samples for item in output.scheduled] == [1, 1]
    complete(scheduler, output)
    assert long.num_tokens == 81 and long.num_computed_tokens == 80


def test_decode_allocates_a_block_at_boundary() -> None:
    scheduler = make()
    seq = add(scheduler, 16)
    complete(scheduler, scheduler.schedule())
    assert seq.block_table == [0]
    output = scheduler.schedule()
    assert planned(output) == [(seq.seq_id, 16, 1)]
    assert seq.block_table == [0, 1]


def test_preemption_takes_newest_and_requeues_it_first() -> None:
    scheduler = make(num_blocks=4)
    old = add(scheduler, 32, first_token=0)  # 2 blocks
    new = add(scheduler, 32, first_token=1000)  # 2 blocks: the pool is full
    output = scheduler.schedule()
    assert planned(output) == [(old.seq_id, 0, 32), (new.seq_id, 0, 32)]
    complete(scheduler, output)
    output = scheduler.schedule()  # both need a third block; only the oldest can have one
    assert output.preempted == [new]
    assert planned(output) == [(old.seq_id, 32, 1)]
    assert output.released_seq_ids == [new.seq_id]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert list(scheduler.waiting) == [new]
    assert old.block_table == [0, 1, 3]  # new's last block (freed first) was reused last
    complete(scheduler, output)
    scheduler.finish(old, FinishReason.LENGTH)
    output = scheduler.schedule()
    # Recomputed from all its tokens, with its own first block revived from the prefix cache.
    assert planned(output) == [(new.seq_id, 16, 17)]
    assert output.scheduled[0].is_new_on_worker


def test_running_sequence_preempts_itself_when_alone() -> None:
    scheduler = make(num_blocks=2)
    seq = add(scheduler, 32)
    complete(scheduler, scheduler.schedule())
    output = scheduler.schedule()
    assert output.preempted == [seq] and output.scheduled == []


def test_waiting_not_admitted_in_a_step_that_preempted() -> None:
    scheduler = make(num_blocks=4)
    a = add(scheduler, 32)
    b = add(scheduler, 31, first_token=500)
    complete(scheduler, scheduler.schedule())
    c = add(scheduler, 1, first_token=900)
    output = scheduler.schedule()
    assert output.preempted == [b]
    assert [item.seq for item in output.scheduled] == [a]
    assert list(scheduler.waiting) == [b, c]


def test_lookahead_does_not_schedule_past_max_tokens() -> None:
    scheduler = make()
    seq = add(scheduler, 10, max_tokens=1)
    output = scheduler.schedule()  # the prefill samples the only token; its reply is pending
    assert seq.num_pending_tokens == 1
    assert scheduler.schedule().scheduled == []
    complete(scheduler, output)
    assert seq.num_pending_tokens == 0


def test_lookahead_schedules_pending_decode() -> None:
    scheduler = make()
    seq = add(scheduler, 10)
    scheduler.schedule()  # prefill in flight
    output = scheduler.schedule()  # decode of the pending token, before the reply
    assert planned(output) == [(seq.seq_id, 10, 1)]
    assert seq.num_pending_tokens == 2


def test_decode_only_steps_run_several_iterations() -> None:
    scheduler = make(num_decode_steps=4)
    a, b = add(scheduler, 15), add(scheduler, 20, first_token=500)
    output = scheduler.schedule()
    assert output.num_decode_steps == 1  # prefills
    complete(scheduler, output)
    output = scheduler.schedule()
    assert output.num_decode_steps == 4
    assert planned(output) == [(a.seq_id, 15, 4), (b.seq_id, 20, 4)]
    assert [item.num_samples for item in output.scheduled] == [4, 4]
    assert a.block_table == [0, 3] and a.num_pending_tokens == 4  # b took 1, 2; slots up to position 18
    complete(scheduler, output)
    assert a.num_tokens == 20 and a.num_computed_tokens == 19


def test_waiting_sequence_forces_single_iteration_steps() -> None:
    scheduler = make(num_decode_steps=4)
    add(scheduler, 10)
    complete(scheduler, scheduler.schedule())
    add(scheduler, 10, first_token=300)
    output = scheduler.schedule()
    assert output.num_decode_steps == 1 and len(output.scheduled) == 2


def test_iterations_stop_at_max_model_len() -> None:
    scheduler = make(num_decode_steps=8, max_model_len=20)
    seq = add(scheduler, 17, max_tokens=100)
    complete(scheduler, scheduler.schedule())
    output = scheduler.schedule()
    assert output.num_decode_steps == 3  # positions 17, 18, 19
    assert seq.num_computed_tokens == 20


def decoding_scheduler(num_sequences: int, **config: int | float) -> Scheduler:
    """A scheduler whose sequences are past their prefill, each decoding."""
    scheduler = make(max_num_seqs=16, max_model_len=100_000, num_blocks=4096, **config)
    for index in range(num_sequences):
        add(scheduler, 10, first_token=100 * index, max_tokens=10_000)
    complete(scheduler, scheduler.schedule())
    return scheduler


def observe(scheduler: Scheduler, periods_s: list[float], num_iterations: int = 4) -> None:
    for period_s in periods_s:
        scheduler.observe_decode_period(num_iterations, period_s)


@pytest.mark.parametrize(("iteration_ms", "expected"),
                         [(0.5, 16), (1.0, 8), (1.9, 4), (3.0, 4), (0.01, MAX_DECODE_STEPS)])
def test_a_lone_sequences_short_iterations_make_its_steps_last_about_decode_step_ms(iteration_ms: float,
                                                                                      expected: int) -> None:
    scheduler = decoding_scheduler(1, num_decode_steps=4, decode_step_ms=8.0)
    observe(scheduler, [4 * iteration_ms / 1e3] * (MIN_DECODE_PERIODS - 1))
    assert scheduler.schedule().num_decode_steps == 4  # too few steps measured yet
    observe(scheduler, [4 * iteration_ms / 1e3])
    assert scheduler.schedule().num_decode_steps == expected


def test_a_held_up_reply_does_not_shorten_the_time_per_iteration() -> None:
    """Replies of 160 ms steps where one came 159 ms late: one period of 1 ms after one of 319 ms.
    The last period alone would say 0.25 ms an iteration (64 of them in 8 ms); the sum says 40."""
    scheduler = decoding_scheduler(1, num_decode_steps=4, decode_step_ms=8.0)
    observe(scheduler, [0.160, 0.160, 0.319, 0.001])
    assert scheduler.schedule().num_decode_steps == 4


def test_the_time_per_iteration_follows_the_last_steps() -> None:
    scheduler = decoding_scheduler(1, num_decode_steps=4, decode_step_ms=8.0)
    observe(scheduler, [0.160] * DECODE_PERIOD_WINDOW)  # 40 ms an iteration
    observe(scheduler, [0.004] * DECODE_PERIOD_WINDOW)  # then 1 ms: the slow steps have left the window
    assert scheduler.schedule().num_decode_steps == 8


@pytest.mark.parametrize(("num_sequences", "decode_step_ms"), [(1, 0.0), (2, 8.0), (5, 8.0)])
def test_num_decode_steps_holds_without_decode_step_ms_or_for_several_sequences(num_sequences: int,
                                                                                decode_step_ms: float) -> None:
    scheduler = decoding_scheduler(num_sequences, num_decode_steps=4, decode_step_ms=decode_step_ms)
    observe(scheduler, [0.001] * MIN_DECODE_PERIODS)
    assert scheduler.schedule().num_decode_steps == 4


def test_lengthened_decode_steps_stay_within_the_token_budget() -> None:
    scheduler = decoding_scheduler(1, num_decode_steps=2, max_num_batched_tokens=10)
    observe(scheduler, [0.0002] * MIN_DECODE_PERIODS, num_iterations=2)  # 0.1 ms an iteration: 80 in 8 ms
    assert scheduler.schedule().num_decode_steps == 10


def test_a_waiting_sequence_still_forces_single_iterations_after_short_ones() -> None:
    scheduler = decoding_scheduler(1, num_decode_steps=4)
    observe(scheduler, [0.001] * MIN_DECODE_PERIODS)
    add(scheduler, 10, first_token=900)
    assert scheduler.schedule().num_decode_steps == 1


def test_penalties_force_single_iteration_steps() -> None:
    scheduler = make(num_decode_steps=4)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=50, repetition_penalty=1.2))
    scheduler.add(seq)
    complete(scheduler, scheduler.schedule())
    assert scheduler.schedule().num_decode_steps == 1
