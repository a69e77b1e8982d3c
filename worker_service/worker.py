"""The worker's engine-facing core: Describe, InitCache, Step and Release over protobuf messages.
The gRPC servicer and the in-process offline engine both call this."""
from __future__ import annotations

import time

from common.config import WorkerConfig
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.batch import apply_step, build_model_input
from worker_service.model_runner import ModelRunner
from worker_service.sampler import SamplerOutput
from worker_service.sequence_state import WorkerSequence


class WorkerCore:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.runner.available_kv_blocks()  # profiles GPU memory now, so that Describe answers at once
        self.seq_id_to_state: dict[int, WorkerSequence] = {}
        self._last_step_id = 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.model_config.eos_token_ids

    def describe(self, request: worker_pb2.DescribeRequest | None = None) -> worker_pb2.DescribeResponse:
        runner = self.runner
        return worker_pb2.DescribeResponse(
            model_name=runner.model_name,
            dtype=str(runner.dtype).removeprefix("torch."),
            block_size=self.config.block_size,
            max_model_len=runner.max_model_len,
            vocab_size=runner.vocab_size,
            num_kv_blocks=runner.num_kv_blocks or runner.available_kv_blocks(),
            device=str(runner.device),
            tensor_parallel_size=1,
            eos_token_ids=self.eos_token_ids,
            num_held_sequences=len(self.seq_id_to_state),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )

    def init_cache(self, request: worker_pb2.InitCacheRequest) -> worker_pb2.InitCacheResponse:
        available = self.runner.num_kv_blocks or self.runner.available_kv_blocks()
        if not 1 <= request.num_kv_blocks <= available:
            raise ValueError(f"num_kv_blocks: must be in [1, {available}], got {request.num_kv_blocks}")
        self.seq_id_to_state.clear()
        self._last_step_id = 0
        return worker_pb2.InitCacheResponse(num_kv_blocks=self.runner.init_cache(request.num_kv_blocks))

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        for seq_id in request.seq_ids:
            self.seq_id_to_state.pop(seq_id, None)
        return worker_pb2.ReleaseResponse()

    def step(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        started = time.perf_counter()
        if request.step_id != self._last_step_id + 1:
            raise ValueError(f"step_id: expected {self._last_step_id + 1}, got {request.step_id}")
        self._last_step_id = request.step_id
        chunks = apply_step(request, self.seq_id_to_state)
        response = worker_pb2.StepResponse(step_id=request.step_id)
        if chunks:
            model_input = build_model_input(chunks, self.config.block_size)
            output = self.runner.run(model_input)
            for chunk in chunks:
                chunk.state.num_computed_tokens += len(chunk.token_ids)
                chunk.state.last_token = None
            if output is not None:
                self._record_samples(model_input.sampled_chunks, output, response)
        response.worker_time_us = int((time.perf_counter() - started) * 1e6)
        return response

    @staticmethod
    def _record_samples(chunks, output: SamplerOutput, response: worker_pb2.StepResponse) -> None:
        token_ids = output.token_ids.tolist()  # the one host sync of the step
        logprobs = output.logprobs.tolist() if output.logprobs is not None else None
        top_ids = output.top_token_ids.tolist() if output.top_token_ids is not None else None
        top_values = output.top_logprobs.tolist() if output.top_logprobs is not None else None
        for row, chunk in enumerate(chunks):
            state = chunk.state
            token_id = token_ids[row]
            state.last_token = token_id
            state.num_tokens += 1
            if state.token_ids is not None:
                state.token_ids.append(token_id)
            sampled = response.tokens.add(seq_id=state.seq_id, token_id=token_id)
            if state.sampling.return_logprobs and logprobs is not None:
                sampled.logprob = logprobs[row]
                num_top = state.sampling.num_top_logprobs
                if num_top and top_ids is not None:
                    for token, value in zip(top_ids[row][:num_top], top_values[row][:num_top], strict=True):
                        sampled.top_logprobs.add(token_id=token, logprob=value)
