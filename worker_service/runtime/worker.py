"""The worker's engine-facing core: Describe, InitCache, Step and Release over protobuf messages.
The gRPC servicer and the in-process offline engine both call this.

A step is launched (host bookkeeping, inputs copied, GPU work queued) and read back later, so that
the next step can be launched while this one runs on the GPU: a decode token sampled by a step not
yet read back is taken from that step's device output. A sequence under a grammar the worker advances
(NewSequence.grammar) is the exception: its mask needs its last token on the host, so once the step's
forward pass is queued the launch waits for the previous step's tokens (only then, and only when
such a row samples), while the GPU computes.
"""
from __future__ import annotations

import gc
import logging
import threading

import torch

from common.contract.config import WorkerConfig
from common.contract.worker_description import WorkerDescription
from common.gc_pauses import freeze_startup_objects
from common.generated.nanovllm.worker.v1 import worker_pb2
from worker_service.runtime.batch import ScheduledChunk, build_model_input
from worker_service.runtime.model_runner import HostTokens, ModelRunner, StepOutput
from worker_service.runtime.prompt_logprobs import record_prompt_logprobs
from worker_service.runtime.sequence_state import PendingToken, WorkerSequence
from worker_service.runtime.step_deltas import apply_step
from worker_service.sampling.grammar_matchers import WorkerGrammars
from worker_service.sampling.sampler import SamplerOutput

logger = logging.getLogger(__name__)


class StepOrderError(ValueError):
    """A step id out of order: already used by this session, or skipping one (FAILED_PRECONDITION)."""


class PendingStep:
    """A launched step whose sampled tokens are still on the device (or being copied back)."""

    def __init__(self, lock: threading.Lock, step_id: int, chunks: list[ScheduledChunk],
                 output: StepOutput | None, previous: PendingStep | None) -> None:
        """output: None when the step computed nothing."""
        self.lock = lock
        self.step_id = step_id
        self.chunks = chunks
        self.previous = previous
        samples = output.samples if output is not None else None
        prompt = output.prompt if output is not None else None
        # The last token of each row: what the next decode step of that sequence computes.
        self.device_token_ids = samples.token_ids[:, -1] if samples is not None else None
        self._host = samples.map(_copy_to_host) if samples is not None else None
        self._host_prompt = prompt.map(_copy_to_host) if prompt is not None else None
        self._event = None
        if (samples is not None and samples.token_ids.is_cuda) or (prompt is not None and prompt.logprobs.is_cuda):
            self._event = torch.cuda.Event()
            self._event.record()
        self._response: worker_pb2.StepResponse | None = None

    @property
    def is_read_back(self) -> bool:
        """Whether its tokens are recorded (result() ran, or a later launch needed them)."""
        return self._response is not None

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
        if self._host_prompt is not None:
            record_prompt_logprobs(self._host_prompt, response)
        self._host = self._host_prompt = None
        return response


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy of a device tensor into pinned host memory."""
    if not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _record_samples(step: PendingStep, output: SamplerOutput, response: worker_pb2.StepResponse) -> None:
    """One entry per sampled token: each row's decode steps as consecutive entries."""
    token_ids = output.token_ids.tolist()
    logprobs = output.logprobs.tolist() if output.logprobs is not None else None
    top_ids = output.top_token_ids.tolist() if output.top_token_ids is not None else None
    top_values = output.top_logprobs.tolist() if output.top_logprobs is not None else None
    for row, chunk in enumerate(c for c in step.chunks if c.samples):
        state = chunk.state
        state.record_sampled(step, token_ids[row])
        num_top = state.sampling.num_top_logprobs
        for index, token_id in enumerate(token_ids[row]):
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
        # Launch and read-back may run on different threads: the lock guards the sequences' state while a
        # step is laid out and while a read-back records its tokens, never across the model's work.
        self.lock = threading.Lock()
        self.next_step_id = 1
        self._last_launched: PendingStep | None = None
        # The session's grammars (its InitCache sent a grammar tokenizer), and the last ones built: a new
        # session with the same tokenizer (a scheduler restarted) keeps them.
        self.grammars: WorkerGrammars | None = None
        self._built_grammars: WorkerGrammars | None = None

    def describe(self) -> worker_pb2.DescribeResponse:
        runner, config = self.runner, self.config
        return WorkerDescription(
            model_name=config.model, dtype=str(runner.dtype).removeprefix("torch."),
            block_size=config.block_size, max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
            num_kv_blocks=runner.num_kv_blocks or runner.available_kv_blocks(), device=str(runner.device),
            tensor_parallel_size=config.tensor_parallel_size, eos_token_ids=runner.model_config.eos_token_ids,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            num_held_sequences=len(self.seq_id_to_state),
        ).to_proto()

    def init_cache(self, request: worker_pb2.InitCacheRequest) -> worker_pb2.InitCacheResponse:
        available = self.runner.num_kv_blocks or self.runner.available_kv_blocks()
        if not 1 <= request.num_kv_blocks <= available:
            raise ValueError(f"num_kv_blocks: must be in [1, {available}], got {request.num_kv_blocks}")
        vocab_size = request.grammar_tokenizer.vocab_size
        if request.HasField("grammar_tokenizer") and vocab_size != self.runner.vocab_size:
            raise ValueError(f"grammar_tokenizer.vocab_size: must be this worker's {self.runner.vocab_size}, "
                             f"got {vocab_size}")
        if self._last_launched is not None:
            self._last_launched.result()
        self.seq_id_to_state.clear()
        self.next_step_id = 1
        self._last_launched = None
        self.grammars = self._grammars_of(request)
        num_blocks = self.runner.init_cache(request.num_kv_blocks)
        freeze_startup_objects()  # graphs are captured: start-up is over
        return worker_pb2.InitCacheResponse(num_kv_blocks=num_blocks)

    def _grammars_of(self, request: worker_pb2.InitCacheRequest) -> WorkerGrammars | None:
        """The grammars of the session InitCache claims (None: it sends none). A tokenizer the grammar
        library cannot read leaves the session without: the scheduler's library, given the same, refuses
        it too, and sends no grammar."""
        if not request.HasField("grammar_tokenizer"):
            return None
        built = self._built_grammars
        if built is not None and built.spec.to_proto() == request.grammar_tokenizer:
            return built
        try:
            self._built_grammars = WorkerGrammars.of(request.grammar_tokenizer)
        except ValueError as error:
            logger.warning("the session's grammars cannot be advanced here: %s", error)
            return None
        return self._built_grammars

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
        if self.grammars is not None:
            self._compile_grammars(request)
        with self.lock:
            if request.step_id != self.next_step_id:
                # Names only the caller's own id: the next one is the session's business.
                raise StepOrderError(f"step_id: {request.step_id} "
                                     + ("was already used" if request.step_id < self.next_step_id else "skips a step"))
            self.next_step_id = request.step_id + 1
            chunks = apply_step(request, self.seq_id_to_state, self.runner.vocab_size, self.grammars)
        self._resolve_history_sources(chunks)
        num_decode_steps = max(request.num_decode_steps, 1)
        output = None
        if chunks:
            with self.lock:
                model_input = build_model_input(chunks, self.config.block_size, self.runner.device)
            # Not under the lock: a grammar's row waits there for an earlier step's read-back, which takes it.
            # Only for a step with a row under a grammar: the others copy no token to the host.
            has_grammar_rows = self.grammars is not None and any(c.state.grammar is not None for c in chunks)
            before_sampling = self._fill_grammar_masks if has_grammar_rows else None
            output = self.runner.run(model_input, num_decode_steps, before_sampling)
        with self.lock:
            if output is not None and output.prompt is not None:
                for state, tail in output.prompt.tails:
                    state.keep_prompt_logits(tail)
            pending = PendingStep(self.lock, request.step_id, chunks, output, self._last_launched)
            row = 0
            for chunk in chunks:
                chunk.state.advance(len(chunk.token_ids), num_decode_steps,
                                    PendingToken(pending, row) if chunk.samples else None)
                row += chunk.samples
        self._last_launched = pending
        return pending

    def _compile_grammars(self, request: worker_pb2.StepRequest) -> None:
        """Compiles the grammars of the step's new sequences before the lock is taken (milliseconds each
        for a JSON schema the first time): read-backs of earlier steps need not wait for them. A refused
        grammar is left for apply_step to report."""
        for new in request.new_sequences:
            if new.HasField("grammar"):
                try:
                    self.grammars.compile(new.grammar.grammar)  # type: ignore[union-attr]
                except ValueError:
                    pass

    def _fill_grammar_masks(self, chunks: list[ScheduledChunk], previous: HostTokens | None) -> bool:
        """Sets the token mask of each sampling chunk under a grammar, once its matcher has consumed every
        earlier token: at a step's first iteration (previous None) a decode's token from a step not read
        back yet is read back first (that records it); at a later iteration the tokens the previous one
        sampled (previous, [rows]) are read back for those rows alone. Called by the runner once the
        iteration's forward pass is queued, so that this overlaps it. Returns whether any mask was set."""
        rows = [chunk for chunk in chunks if chunk.state.grammar is not None]
        if not rows:
            return False
        if previous is None:
            for chunk in rows:
                if chunk.token_source is not None:
                    chunk.token_source.step.result()  # the earlier steps too: they resolve in order
        else:
            token_ids = previous.tolist()
            for index, chunk in enumerate(chunks):
                if chunk.state.grammar is not None:
                    chunk.state.grammar.take_early(token_ids[index])
        masks = self.grammars.fill_masks([chunk.state.grammar for chunk in rows])  # type: ignore[union-attr,misc]
        for chunk, mask in zip(rows, masks, strict=True):
            chunk.token_mask = mask
        return True

    @staticmethod
    def _resolve_history_sources(chunks: list[ScheduledChunk]) -> None:
        """A penalty needs the previous token's value on the host: wait for the step that sampled it."""
        for chunk in chunks:
            if chunk.token_source is not None and chunk.state.token_ids is not None:
                chunk.token_source.step.result()
