"""The worker's engine-facing core: Describe, InitCache, Step and Release over protobuf messages.
The gRPC servicer and the in-process offline engine both call this.

A step is launched (host bookkeeping, inputs copied, GPU work queued) and read back later, so that
the next step can be launched while this one runs on the GPU: a decode token sampled by a step not
yet read back is taken from that step's device output.
"""
from __future__ import annotations

import gc
import threading
import time

import torch

from common.contract.config import WorkerConfig
from common.contract.lookahead import num_sampled_tokens
from common.gc_pauses import freeze_startup_objects
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.api.statuses import StepOrderError
from worker_service.runtime.batch import ScheduledChunk, apply_step, build_model_input
from worker_service.runtime.model_runner import ModelRunner
from worker_service.runtime.sequence_state import PendingToken, WorkerSequence
from worker_service.sampling.sampler import SamplerOutput


class PendingStep:
    """A launched step whose sampled tokens are still on the device (or being copied back)."""

    def __init__(self, lock: threading.Lock, step_id: int, chunks: list[ScheduledChunk],
                 output: SamplerOutput | None, previous: PendingStep | None, started: float) -> None:
        """output: tensors of [num_sampling_rows, num_iterations]."""
        self.lock = lock
        self.step_id = step_id
        self.chunks = chunks
        self.started = started
        self.previous = previous
        # The last token of each row: what the next decode step of that sequence computes.
        self.device_token_ids = output.token_ids[:, -1] if output is not None else None
        self._host = output.map(_copy_to_host) if output is not None else None
        self._event = None
        if output is not None and output.token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._response: worker_pb2.StepResponse | None = None

    def result(self) -> worker_pb2.StepResponse:
        """Waits for the step's tokens and records them; steps resolve in launch order."""
        if self._response is not None:
            return self._response
        if self.previous is not None:
            self.previous.result()
            self.previous = None
        if self._event is not None:
            self._event.synchronize()
        with self.lock:
            if self._response is None:
                self._response = self._build_response()
        return self._response

    def _build_response(self) -> worker_pb2.StepResponse:
        response = worker_pb2.StepResponse(step_id=self.step_id)
        if self._host is not None:
            _record_samples(self, self._host, response)
        self._host = None
        response.worker_time_us = int((time.perf_counter() - self.started) * 1e6)
        return response


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of a device tensor into pinned host memory."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _record_samples(step: PendingStep, output: SamplerOutput, response: worker_pb2.StepResponse) -> None:
    """One entry per sampled token: each row's iterations as consecutive entries."""
    token_ids = output.token_ids.tolist()
    logprobs = output.logprobs.tolist() if output.logprobs is not None else None
    top_ids = output.top_token_ids.tolist() if output.top_token_ids is not None else None
    top_values = output.top_logprobs.tolist() if output.top_logprobs is not None else None
    for row, chunk in enumerate(c for c in step.chunks if c.samples):
        state = chunk.state
        row_tokens = token_ids[row]
        if state.pending is not None and state.pending.step is step:
            state.pending = None
            state.last_token = row_tokens[-1]
        if state.token_ids is not None:
            state.token_ids.extend(row_tokens)
        num_top = state.sampling.num_top_logprobs
        for index, token_id in enumerate(row_tokens):
            sampled = response.tokens.add(seq_id=state.seq_id, token_id=token_id)
            if state.sampling.logprobs and logprobs is not None:
                sampled.logprob = logprobs[row][index]
                if num_top and top_ids is not None and top_values is not None:
                    for token, value in zip(top_ids[row][index][:num_top], top_values[row][index][:num_top],
                                            strict=True):
                        sampled.top_logprobs.add(token_id=token, logprob=value)


class WorkerCore:
    """One rank's worker: the model runner and the per-sequence state between steps. Steps must come
    in step_id order (1, 2, ... after each InitCache); this is the one place that checks it."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.runner.available_kv_blocks()  # profiles GPU memory now, so that Describe answers at once
        self.seq_id_to_state: dict[int, WorkerSequence] = {}
        self.lock = threading.Lock()  # launch and read-back may run on different threads
        self.next_step_id = 1
        self._last_launched: PendingStep | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.model_config.eos_token_ids

    def describe(self) -> worker_pb2.DescribeResponse:
        runner = self.runner
        return worker_pb2.DescribeResponse(
            model_name=runner.model_name,
            dtype=str(runner.dtype).removeprefix("torch."),
            block_size=self.config.block_size,
            max_model_len=runner.max_model_len,
            vocab_size=runner.vocab_size,
            num_kv_blocks=runner.num_kv_blocks or runner.available_kv_blocks(),
            device=str(runner.device),
            tensor_parallel_size=self.config.tensor_parallel_size,
            eos_token_ids=self.eos_token_ids,
            num_held_sequences=len(self.seq_id_to_state),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )

    def init_cache(self, request: worker_pb2.InitCacheRequest) -> worker_pb2.InitCacheResponse:
        available = self.runner.num_kv_blocks or self.runner.available_kv_blocks()
        if not 1 <= request.num_kv_blocks <= available:
            raise ValueError(f"num_kv_blocks: must be in [1, {available}], got {request.num_kv_blocks}")
        if self._last_launched is not None:
            self._last_launched.result()
        self.seq_id_to_state.clear()
        self.next_step_id = 1
        self._last_launched = None
        num_blocks = self.runner.init_cache(request.num_kv_blocks)
        freeze_startup_objects()  # graphs are captured: start-up is over
        return worker_pb2.InitCacheResponse(num_kv_blocks=num_blocks)

    def close(self) -> None:
        """Frees the CUDA graphs and the KV cache. Before a tensor-parallel group is torn down this
        is required: graphs that captured NCCL kernels keep the communicator busy, and its teardown
        then never finishes (seen on the H200)."""
        self.runner.release_cache()
        gc.collect()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()

    def release(self, request: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        with self.lock:
            for seq_id in request.seq_ids:
                self.seq_id_to_state.pop(seq_id, None)
        return worker_pb2.ReleaseResponse()

    @torch.inference_mode()
    def launch(self, request: worker_pb2.StepRequest) -> PendingStep:
        """Queues one step's work; its tokens are read back by PendingStep.result()."""
        started = time.perf_counter()
        with self.lock:
            if request.step_id != self.next_step_id:
                # Names only the caller's own id: the next one is the session's business.
                raise StepOrderError(f"step_id: {request.step_id} "
                                     + ("was already used" if request.step_id < self.next_step_id else "skips a step"))
            self.next_step_id = request.step_id + 1
            chunks = apply_step(request, self.seq_id_to_state)
        self._resolve_history_sources(chunks)
        num_steps = max(request.num_decode_steps, 1)
        output = None
        with self.lock:
            if chunks:
                output = self.runner.run(build_model_input(chunks, self.config.block_size), num_steps)
            pending = PendingStep(self.lock, request.step_id, chunks, output, self._last_launched, started)
            row = 0
            for chunk in chunks:
                state = chunk.state
                state.num_computed_tokens += len(chunk.token_ids) + num_steps - 1
                state.num_tokens += num_sampled_tokens(state.num_tokens, state.num_computed_tokens)
                state.last_token = None
                state.pending = None
                if chunk.samples:
                    state.pending = PendingToken(pending, row)
                    row += 1
        self._last_launched = pending
        return pending

    @staticmethod
    def _resolve_history_sources(chunks: list[ScheduledChunk]) -> None:
        """A penalty needs the previous token's value on the host: wait for the step that sampled it."""
        for chunk in chunks:
            if chunk.token_source is not None and chunk.state.token_ids is not None:
                chunk.token_source.step.result()
