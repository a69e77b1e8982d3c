"""The offline API: scheduler and worker in one process, talking through the same Step messages
that cross gRPC between the services."""
from __future__ import annotations

import time
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm.auto import tqdm

from common.config import SchedulerConfig, WorkerConfig, split_options
from common.gc_pauses import freeze_startup_objects
from common.generated.nanovllm.worker.v1 import worker_pb2
from common.sampling_params import SamplingParams
from scheduler_service.engine_core import EngineCore, TokenUpdate
from scheduler_service.sequence import Sequence
from scheduler_service.tokenizer import eos_token_ids, load_tokenizer
from scheduler_service.worker_lane import worker_info_from

Prompt = str | list[int]


class LLM:
    """`LLM(model_path, **options).generate(prompts, sampling_params)`, as nano-vllm's.

    Options are the fields of SchedulerConfig and WorkerConfig (block_size, max_num_seqs,
    max_num_batched_tokens, max_model_len, num_kv_blocks, dtype, device, tensor_parallel_size, ...).
    With tensor_parallel_size > 1 this process is rank 0 and the other ranks are child processes
    until close().
    """

    def __init__(self, model: str, **options: Any) -> None:
        scheduler_options, worker_options = split_options(options)
        self.scheduler_config = SchedulerConfig(**scheduler_options)
        worker_config = WorkerConfig(model=model, **worker_options)
        from worker_service.tp_group import create_worker_core  # torch is imported only here

        self.worker = create_worker_core(worker_config)
        describe = self.worker.describe()
        if describe.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks: the memory budget holds no KV block")
        num_blocks = self.worker.init_cache(worker_pb2.InitCacheRequest(num_kv_blocks=describe.num_kv_blocks))
        self.tokenizer = load_tokenizer(model)
        eos = eos_token_ids(model, self.tokenizer) | set(self.worker.eos_token_ids)
        self.engine = EngineCore(self.scheduler_config, worker_info_from(describe, num_blocks.num_kv_blocks), eos)
        freeze_startup_objects()

    def close(self) -> None:
        """Stops the worker's other ranks (tensor parallelism); a no-op for one rank."""
        self.worker.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: this checkpoint has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict[str, Any]]:
        """Returns {"text", "token_ids", "finish_reason"} per prompt, in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = _broadcast_params(sampling_params, len(prompts))
        token_lists = [self.encode(p) for p in prompts]
        for tokens in token_lists:  # all of them before any is queued
            self.engine.validate(tokens)
        sequences = [self.engine.add_request(t, p, self.tokenizer)
                     for t, p in zip(token_lists, params_list, strict=True)]
        self._run(len(sequences), use_tqdm)
        return [self._result(seq) for seq in sequences]

    def _run(self, num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        rates = {"prefill": "0tok/s", "decode": "0tok/s"}  # each step's, the last nonzero of each
        in_flight = None  # (the step, the worker's handle on it): one step of lookahead
        while self.engine.has_unfinished or in_flight is not None:
            started = time.perf_counter()
            step = self.engine.build_step() if self.engine.has_unfinished else None
            # Launched before the previous step is read back: the worker queues it behind that one.
            launched = self.worker.launch(step.request) if step is not None else None
            if in_flight is None:
                if step is None:
                    raise RuntimeError("the scheduler has unfinished requests but cannot schedule any")
                in_flight = (step, launched)
                continue
            done, handle = in_flight
            in_flight = (step, launched) if step is not None else None
            updates = self.engine.process_step(done, handle.result())
            if use_tqdm:  # counting a step's tokens costs ~0.2 ms at 256 sequences: not for a hidden bar
                _show_progress(bar, rates, done.request, updates, time.perf_counter() - started)
        bar.close()

    def _result(self, seq: Sequence) -> dict[str, Any]:
        text = ""
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
            text = seq.detokenizer.text
        token_ids = seq.output_token_ids
        return {"text": text, "token_ids": token_ids, "finish_reason": seq.finish_reason.name.lower()}


def _show_progress(bar: tqdm, rates: dict[str, str], request: worker_pb2.StepRequest, updates: list[TokenUpdate],
                   elapsed: float) -> None:
    num_prefill = sum(len(s.token_ids) for s in request.new_sequences) + sum(
        len(s.token_ids) for s in request.running_sequences)
    num_decode = sum(1 for s in request.running_sequences if not s.token_ids) * max(request.num_decode_steps, 1)
    if num_prefill:
        rates["prefill"] = f"{num_prefill / elapsed:.0f}tok/s"
    if num_decode:
        rates["decode"] = f"{num_decode / elapsed:.0f}tok/s"
    bar.update(sum(1 for update in updates if update.finished))
    bar.set_postfix(rates)


def _broadcast_params(params: SamplingParams | SequenceABC[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return params
