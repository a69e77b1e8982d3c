"""The sampling parameter table agrees with both .proto files, and the Step conversion round-trips."""
from __future__ import annotations

from dataclasses import replace

from common.client import SAMPLING_FIELDS
from common.contract.sampling_params import PARAMS, WORKER_PARAMS, SamplingParams
from common.generated.nanovllm.generate.v1 import generate_pb2
from common.generated.nanovllm.worker.v1 import worker_pb2


def test_every_parameter_travels_in_fields_of_both_protos() -> None:
    request_fields = generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert set(SAMPLING_FIELDS) == set(request_fields) - {"request_id", "text", "token_ids", "chat"}
    assert all(p.public in request_fields for p in PARAMS)
    # The worker's message holds the parameters it needs and nothing else (the ids min_tokens holds
    # back are the scheduler's to add: they depend on its EOS ids).
    assert {p.worker for p in WORKER_PARAMS} | {"min_tokens_banned_ids"} == set(
        worker_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def test_step_conversion_round_trips_what_the_worker_needs() -> None:
    # Values exact in float32, so the wire's rounding changes nothing.
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.75, min_p=0.25, repetition_penalty=1.5,
                            frequency_penalty=-0.5, presence_penalty=0.5, seed=2**63 - 1, logprobs=True,
                            num_top_logprobs=4, max_tokens=99, stop=["x"], ignore_eos=True)
    assert SamplingParams.from_proto(params.to_proto()) == replace(params, max_tokens=16, stop=(), ignore_eos=False)
    assert SamplingParams().to_proto().ByteSize() == 0  # neutral values stay off the wire
    assert params.needs_token_history and not SamplingParams(temperature=0).needs_token_history


def test_top_logprobs_need_logprobs() -> None:
    import pytest

    with pytest.raises(ValueError) as raised:
        SamplingParams(num_top_logprobs=1)
    assert str(raised.value) == "num_top_logprobs: needs logprobs: true (got 1 with logprobs: false)"
    with pytest.raises(ValueError, match="^num_top_logprobs: needs logprobs: true"):
        SamplingParams.from_proto(worker_pb2.SamplingParams(num_top_logprobs=2))
    assert SamplingParams(logprobs=True, num_top_logprobs=1).num_top_logprobs == 1
    assert SamplingParams(logprobs=True).num_top_logprobs == 0
