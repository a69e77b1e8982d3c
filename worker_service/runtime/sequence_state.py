"""What a worker remembers of a sequence between steps: no more than the next step needs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from common.contract.sampling_params import SamplingParams
from common.generated.nanovllm.worker.v1 import worker_pb2


class InFlightStep(Protocol):
    """A launched step whose sampled tokens may still be on the device (worker.PendingStep)."""

    device_token_ids: torch.Tensor | None  # [num_sampling_rows]: each row's last sampled token

    def result(self) -> worker_pb2.StepResponse:
        """Waits for the step's tokens (and those of every step launched before it)."""
        ...


class PendingToken(NamedTuple):
    """A token sampled by a step not read back yet: row `row` of that step's device output."""

    step: InFlightStep
    row: int


@dataclass
class WorkerSequence:
    seq_id: int
    block_table: list[int]
    num_computed_tokens: int  # tokens whose K/V are in the cache
    num_tokens: int  # tokens the sequence holds, as far as this worker knows
    num_prompt_tokens: int
    sampling: SamplingParams
    last_token: int | None = None  # sampled by this worker, not computed yet
    # While the step that sampled the last token has not been read back: the next decode step takes
    # the token from that step's device tensor, without waiting for it.
    pending: PendingToken | None = None
    # Every token of the sequence, kept only when a penalty needs the history.
    token_ids: list[int] | None = None

    @classmethod
    def from_message(cls, message: worker_pb2.NewSequence) -> WorkerSequence:
        sampling = SamplingParams.from_proto(message.sampling)
        history = None
        if sampling.needs_token_history:
            history = list(message.cached_token_ids)
            if len(history) != message.num_computed_tokens:
                raise ValueError(f"sequence {message.seq_id}: a penalty needs cached_token_ids for all "
                                 f"{message.num_computed_tokens} cached tokens, got {len(history)}")
        return cls(
            seq_id=message.seq_id,
            block_table=list(message.block_table),
            num_computed_tokens=message.num_computed_tokens,
            num_tokens=message.num_tokens,
            num_prompt_tokens=message.num_prompt_tokens,
            sampling=sampling,
            token_ids=history,
        )
