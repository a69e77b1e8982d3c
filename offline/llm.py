"""The offline API: scheduler and worker in one process, talking through the same Step messages
that cross gRPC between the services, driven by the worker lanes' loop (core/step_loop.py drive)."""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Coroutine
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch
from tqdm.auto import tqdm

from common.contract.config import SchedulerConfig, WorkerConfig, split_options
from common.contract.sampling_params import SamplingParams
from common.contract.worker_description import WorkerDescription
from common.formats.checkpoint import resolve_model
from common.formats.default_model import default_model_path
from common.gc_pauses import freeze_startup_objects
from common.generated.nanovllm.worker.v1 import worker_pb2
from scheduler_service.api.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.constraints import ConstraintCompiler, ConstraintState
from scheduler_service.core.engine_core import EngineCore
from scheduler_service.core.outputs import RequestOutput
from scheduler_service.core.sequence import Sequence
from scheduler_service.core.step_builder import InFlightStep
from scheduler_service.core.step_loop import drive
from worker_service.runtime.tp_group import TensorParallelCore, create_worker_core
from worker_service.runtime.worker import PendingStep, WorkerCore

Prompt = str | list[int]


class LLM:
    """`LLM(model, **options).generate(prompts, sampling_params)`, as nano-vllm's. model: a Hugging Face
    checkpoint folder, a .gguf file, or a hub id ("org/name") already in the local Hugging Face cache
    (never downloaded); None: the default model, as `nanovllm serve` (common/formats/default_model.py).
    A model that names nothing usable raises ModelNotFoundError (a FileNotFoundError and a
    ValueError), its message one line. Options are the fields of SchedulerConfig and WorkerConfig
    (block_size, max_num_seqs, num_kv_blocks, dtype, device, tensor_parallel_size, ...); with
    tensor_parallel_size > 1 the other ranks are child processes. A context manager: close() frees
    the model and its memory and stops those ranks."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        scheduler_options, worker_options = split_options(options)
        self.scheduler_config = SchedulerConfig(**scheduler_options)
        model = resolve_model(default_model_path() if model is None else model, "model")
        self.model = model  # the checkpoint's path (a hub id's snapshot folder)
        worker_config = WorkerConfig(model=model, **worker_options)
        self._constraints: ConstraintCompiler | None = None  # made at the first constrained request
        self.worker: WorkerCore | TensorParallelCore | None = create_worker_core(worker_config)
        try:
            describe = self.worker.describe()
            if describe.num_kv_blocks < 1:
                raise ValueError("num_kv_blocks: the memory budget holds no KV block")
            reply = self.worker.init_cache(worker_pb2.InitCacheRequest(num_kv_blocks=describe.num_kv_blocks))
            self.tokenizer = load_tokenizer(model)
            self.engine = EngineCore(self.scheduler_config)
            self.engine.attach(WorkerDescription.from_proto(describe), reply.num_kv_blocks,
                               eos_token_ids(model, self.tokenizer))
        except BaseException:
            self.close()
            raise
        freeze_startup_objects()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops the worker (and its other ranks) and frees all it held: weights, KV cache, CUDA
        graphs. Idempotent; the LLM cannot generate afterwards."""
        if self.worker is not None:
            self.worker.close()
        self.worker = None  # the engine stays: its counters are still read after close()
        if self._constraints is not None:
            self._constraints.close()
        # Start-up froze the worker's cycles (steps and worker) out of the collector's sight (gc_pauses).
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: this checkpoint has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict[str, Any]]:
        """Returns {"text", "token_ids", "finish_reason"} per prompt, in prompt order; with n > 1 those of
        sample 0, and "samples": every sample's, in index order."""
        engine, worker = self.engine, self.worker
        if worker is None:
            raise RuntimeError("generate: this LLM is closed")
        is_one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if is_one else list(prompts)  # type: ignore[list-item,arg-type]
        params_list = _broadcast_params(sampling_params, len(prompts))
        token_lists = [self.encode(p) for p in prompts]
        for tokens in token_lists:  # all of them before any is queued
            engine.validate(tokens)
        constraints = [self._compile(p) for p in params_list]  # all of them too (cached: once per constraint)
        groups = [engine.add_samples(t, p, self.tokenizer, c)
                  for t, p, c in zip(token_lists, params_list, constraints, strict=True)]
        progress = _Progress([seq for group in groups for seq in group], use_tqdm)
        _run_to_end(drive(engine, lambda step, ahead: _read_back(worker.launch(step.request)), progress.on_step))
        progress.bar.close()
        results = []
        for group in groups:
            samples = [_result(seq, engine.text_of(seq)) for seq in group]
            results.append(samples[0] if len(samples) == 1 else {**samples[0], "samples": samples})
        return results


    def _compile(self, params: SamplingParams) -> Callable[[], ConstraintState] | None:
        """params' constraint compiled on this thread (within max_grammar_compile_ms), or None. Raises
        a ValueError (RequestError) naming the field for one that cannot be served."""
        if params.constraint is None:
            return None
        if self.tokenizer is None:
            raise ValueError("constraint: this checkpoint has no tokenizer")
        if self._constraints is None:
            self._constraints = ConstraintCompiler(self.tokenizer, self.scheduler_config.max_grammar_compile_ms)
        served = self.engine.served
        assert served is not None
        return self._constraints.compile_now(params.constraint, served.vocab_size, served.eos_token_ids).new_state


async def _read_back(pending: PendingStep) -> worker_pb2.StepResponse:
    """Waits for a step's tokens (the GPU runs the next step meanwhile), without suspending."""
    return pending.result()


def _run_to_end(coroutine: Coroutine[Any, Any, None]) -> None:
    """Runs drive() without an event loop (so generate works inside one too, as in a notebook):
    it awaits only _read_back, so one send runs it to its end."""
    with contextlib.suppress(StopIteration):
        coroutine.send(None)
        raise RuntimeError("the offline step loop suspended")


class _Progress:
    """The tqdm bar: finished requests, and the prefill and
    decode rates over the run so far: prompt tokens computed (prefix-cache hits aside, recomputed
    ones included) and tokens generated, each per second since generate() began."""

    def __init__(self, sequences: list[Sequence], enabled: bool,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.bar = tqdm(total=len(sequences), desc="Generating", dynamic_ncols=True, disable=not enabled)
        self.rates = {"prefill": "0tok/s", "decode": "0tok/s"}
        self.num_prefill_tokens = 0  # prompt tokens computed so far
        self.num_decode_tokens = 0  # tokens generated so far
        self._clock = clock
        self._started = clock()

    def on_step(self, step: InFlightStep, outputs: list[RequestOutput], period_s: float | None) -> None:
        if self.bar.disable:  # counting a step's tokens costs ~0.2 ms at 256 sequences: not for a hidden bar
            return
        self.bar.update(sum(1 for output in outputs if output.finished))
        request = step.request
        self.num_prefill_tokens += sum(len(s.token_ids) for s in request.new_sequences)
        self.num_prefill_tokens += sum(len(s.token_ids) for s in request.running_sequences)
        self.num_decode_tokens += sum(len(output.token_ids) for output in outputs)
        elapsed_s = self._clock() - self._started
        if elapsed_s > 0:
            self.rates = {"prefill": f"{self.num_prefill_tokens / elapsed_s:.0f}tok/s",
                          "decode": f"{self.num_decode_tokens / elapsed_s:.0f}tok/s"}
        self.bar.set_postfix(self.rates)


def _result(seq: Sequence, text: str) -> dict[str, Any]:
    return {"text": text, "token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason.name.lower()}


def _broadcast_params(params: SamplingParams | SequenceABC[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return params
