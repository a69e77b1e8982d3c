"""build_model_input's attention metadata: a decode-only batch carries the decode kernel's program
order (longest context first), a batch with a prefill chunk none."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from common import SamplingParams  # noqa: E402
from worker_service.runtime.batch import ScheduledChunk, build_model_input  # noqa: E402
from worker_service.runtime.sequence_state import WorkerSequence  # noqa: E402

BLOCK_SIZE = 16


def chunk(seq_id: int, num_computed: int, num_new: int) -> ScheduledChunk:
    blocks = list(range(seq_id * 8, seq_id * 8 + 8))
    state = WorkerSequence(seq_id=seq_id, block_table=blocks, num_computed_tokens=num_computed,
                           num_tokens=num_computed + num_new, num_prompt_tokens=1, sampling=SamplingParams())
    return ScheduledChunk(state, [1] * num_new, samples=True)


def test_a_decode_batch_orders_its_programs_longest_first() -> None:
    model_input = build_model_input([chunk(0, 5, 1), chunk(1, 40, 1), chunk(2, 0, 1), chunk(3, 40, 1)], BLOCK_SIZE)
    assert model_input.metadata.seq_lens.tolist() == [6, 41, 1, 41]
    assert model_input.metadata.decode_order.tolist() == [1, 3, 0, 2]


def test_a_batch_with_a_prefill_has_no_decode_order() -> None:
    model_input = build_model_input([chunk(0, 5, 1), chunk(1, 0, 30)], BLOCK_SIZE)
    assert model_input.metadata.decode_order is None
