"""Converts the worker's per-sequence state into the sampler's batch inputs."""
from __future__ import annotations

from typing import Any

from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.batch import ScheduledChunk
from worker_service.sampling_state import SequenceSamplingParams


def params_from_proto(message: worker_pb2.SamplingParams) -> SequenceSamplingParams:
    """Unset fields take the neutral defaults of SequenceSamplingParams."""
    values = {name: getattr(message, name) for name in (
        "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
        "presence_penalty", "seed", "num_top_logprobs") if message.HasField(name)}
    return SequenceSamplingParams(return_logprobs=message.return_logprobs, **values)


def sampling_batch_inputs(chunks: list[ScheduledChunk]) -> dict[str, Any]:
    """Keyword arguments of SamplingBatch.build (but vocab_size and device) for the sampling chunks."""
    states = [chunk.state for chunk in chunks]
    for state in states:
        if state.sampling_params is None:
            state.sampling_params = params_from_proto(state.sampling)
    indices = [state.num_tokens - state.num_prompt_tokens for state in states]
    if all(state.token_ids is None for state in states):  # no penalties: no token lists at all
        no_tokens: list[int] = []
        return {"params": [s.sampling_params for s in states], "prompt_token_ids": [None] * len(states),
                "output_token_ids": [no_tokens] * len(states), "output_index": indices}
    prompts, outputs = [], []
    for state in states:
        history = state.token_ids or []
        prompts.append(history[:state.num_prompt_tokens] if state.token_ids is not None else None)
        outputs.append(history[state.num_prompt_tokens:])
    return {"params": [s.sampling_params for s in states], "prompt_token_ids": prompts,
            "output_token_ids": outputs, "output_index": indices}
