"""Holds the model and its paged KV cache (kv_cache); runs one forward pass, or a multi-iteration
decode step, and samples (under tensor parallelism from each rank's slice of the vocabulary); scores
prompt tokens for the sequences that ask (prompt_logprobs)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.contract.config import WorkerConfig
from worker_service import invariant
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import kv_cache_torch_dtype
from worker_service.loader.model_loading import load_checkpoint
from worker_service.loader.placement import resolve_device, resolve_dtype, resolve_weights_and_backend
from worker_service.parallel.distributed import (
    all_gather_vocab,
    broadcast_from_first,
    init_symmetric_sum,
    tp_rank,
    tp_size,
)
from worker_service.runtime.batch import ModelInput, ScheduledChunk, build_model_input, sampling_rows
from worker_service.runtime.cuda_graphs import DecodeGraphs, PrefillGraphs
from worker_service.runtime.decode_plan import DecodePlan
from worker_service.runtime.kv_cache import KVCacheSpec, attach_kv_cache, num_fitting_blocks, warmup_steps
from worker_service.runtime.prompt_logprobs import PromptScores, score_prompts
from worker_service.runtime.sequence_state import LaunchedStep
from worker_service.sampling.sampler import Sampler, SamplerOutput, stack_iterations
from worker_service.sampling.sampling_state import SamplingBatch, SamplingRows, host_to_device
from worker_service.sampling.vocab_parallel import VocabSlice


@dataclass(frozen=True)
class StepOutput:
    """What a step computed, on the device: the sampled tokens ([num_sampling_rows, num_decode_steps]
    tensors; None when no chunk samples) and the prompt logprobs (None when no chunk asked)."""

    samples: SamplerOutput | None
    prompt: PromptScores | None


class ModelRunner:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device, tp_rank(), tp_size())
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.weight_format, self.backend = resolve_weights_and_backend(config, self.device)
        self.model, self.model_config = load_checkpoint(config.model, self.dtype, self.device, self.backend,
                                                        self.weight_format)
        if config.deterministic:
            invariant.prepare(self.model)  # the weights' layout for the batch-invariant CPU products
        self.max_model_len = min(config.max_model_len, self.model_config.max_position_embeddings)
        init_symmetric_sum(max(config.max_num_batched_tokens, config.max_num_seqs), self.model_config.hidden_size,
                           self.dtype, self.device)
        self.sampler = Sampler(seed=config.seed)
        head = self.model.lm_head
        self.vocab_slice = VocabSlice(head.vocab_start, head.own_rows, self.vocab_size) if tp_size() > 1 else None
        attention = self.model.attention_layers()[0]  # its head counts are this rank's
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.kv_spec = KVCacheSpec(self.model_config.num_layers, config.block_size,
                                   self.num_kv_heads, self.model_config.head_dim,
                                   kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype))
        self.num_kv_blocks = 0
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None
        self._available_blocks: int | None = None
        self.graphs: list[DecodeGraphs | PrefillGraphs] = []  # tried in order; none: eager

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # KV cache.

    def available_kv_blocks(self) -> int:
        """Blocks that fit (kv_cache.num_fitting_blocks), measured once."""
        if self._available_blocks is None:
            self._available_blocks = num_fitting_blocks(self.config, self.kv_spec, self.device,
                                                        self._warmup_peak_memory)
        return max(self._available_blocks, 0)

    def _warmup_peak_memory(self) -> int:
        """Peak bytes torch allocates in the warm-up step (kv_cache.warmup_steps), without its
        temporary cache; then the small step, which compiles the fused sampling kernel."""
        largest, small = warmup_steps(self.config)
        num_blocks = sum(len(c.state.block_table) for c in largest)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.init_cache(num_blocks, capture_graphs=False)
        self.run(build_model_input(largest, self.config.block_size, self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - num_blocks * self.kv_spec.bytes_per_block
        self.run(build_model_input(small, self.config.block_size, self.device))
        torch.cuda.synchronize(self.device)
        self.release_cache()
        torch.cuda.empty_cache()
        return peak

    def release_cache(self) -> None:
        """Drops the graphs and every reference to the cache (the layers' views too), so that its
        memory can hold the next one: a second InitCache (a scheduler taking the worker over) needs it."""
        self.graphs = []
        self.kv_cache = self.kv_scales = None
        attach_kv_cache(self.model.attention_layers(), None, None)
        self.num_kv_blocks = 0

    def init_cache(self, num_blocks: int, capture_graphs: bool = True) -> int:
        self.release_cache()  # before allocating: the old cache's memory may be needed for the new one
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the old graphs' pool and a cache of another size: back to the device
        self.kv_cache, self.kv_scales = self.kv_spec.allocate(num_blocks, self.device)
        attach_kv_cache(self.model.attention_layers(), self.kv_cache, self.kv_scales)
        self.num_kv_blocks = num_blocks
        if capture_graphs and self.device.type == "cuda" and not self.config.enforce_eager:
            self._capture_graphs()
        return num_blocks

    def _capture_graphs(self) -> None:
        config = self.config
        self.graphs = [DecodeGraphs(self.model, self.model_config, self.backend, config.max_num_seqs,
                                    self.max_model_len, config.block_size, self.device,
                                    (self.num_heads, self.num_kv_heads))]
        if self.backend.graphs_prefill:
            self.graphs.append(PrefillGraphs(self.model, self.model_config,
                                             min(config.max_num_batched_tokens, self.max_model_len),
                                             self.max_model_len, config.block_size, self.device))
        pool = None
        for graphs in self.graphs:
            pool = graphs.capture(pool)

    # Steps.

    @torch.inference_mode()
    def run(self, model_input: ModelInput, num_decode_steps: int = 1,
            before_sampling: Callable[[list[ScheduledChunk], HostTokens | None], bool] | None = None
            ) -> StepOutput:
        """Runs the batch, scores prompt tokens where asked and samples; samples are [num_seqs,
        num_decode_steps]. With num_decode_steps > 1 the batch must be decode-only: each iteration
        feeds the tokens the previous one sampled, without the host in between. before_sampling(the
        sampling chunks, the tokens the previous iteration sampled (HostTokens) or None) runs once each
        iteration's forward pass is queued, before its sampling rows are laid out: host work that may wait (the
        masks of rows under a grammar) overlaps the GPU's. It returns whether it changed a chunk's
        mask (the rows are laid out again)."""
        plan = (DecodePlan.build(model_input, num_decode_steps, self.config.block_size, self.device)
                if num_decode_steps > 1 else None)
        gather = self.vocab_slice is None  # under tensor parallelism each rank keeps its slice (_sample)
        hidden = self._forward_input(model_input)
        prompt = None
        if model_input.prompt_chunks:
            prompt = score_prompts(lambda rows: self.model.compute_logits(rows, True), hidden,
                                   model_input.prompt_chunks)
        if not model_input.sampled_chunks:
            return StepOutput(None, prompt)
        logits = self.model.compute_logits(hidden[model_input.logits_indices], gather)
        # Host work after the forward pass is launched, so that it overlaps the GPU's.
        if before_sampling is not None:
            before_sampling(model_input.sampled_chunks, None)
        rows = sampling_rows(model_input.sampled_chunks)
        batch = SamplingBatch.build(rows, self.vocab_size, self.device)
        outputs = [self._sample(logits, batch)]
        for index in range(1, num_decode_steps):
            assert plan is not None
            # Copied to the host before the next forward pass is queued, so reading them waits for the
            # sampling alone, and the host's work on them overlaps that forward pass.
            previous = HostTokens(outputs[-1].token_ids) if before_sampling is not None else None
            hidden = self._forward(outputs[-1].token_ids, plan.positions[index],
                                   plan.metadata(model_input.metadata, index))
            logits = self.model.compute_logits(hidden, gather)
            new_masks = before_sampling is not None and before_sampling(model_input.sampled_chunks, previous)
            if new_masks:
                rows = sampling_rows(model_input.sampled_chunks)
            if new_masks or _samples_differently(rows, index):
                step_rows = replace(rows, output_index=[i + index for i in rows.output_index])
                batch = SamplingBatch.build(step_rows, self.vocab_size, self.device)
            outputs.append(self._sample(logits, batch))
        return StepOutput(stack_iterations(outputs), prompt)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Samples from the logits: the whole rows, or under tensor parallelism this rank's slice of
        them. There the next step's inputs must agree on every rank: greedy and plain-temperature
        batches sample from the slices (sampling/vocab_parallel.py), where every rank picks the same
        tokens from the same exchanged pairs; others gather the whole rows, and every rank takes rank
        0's tokens (a small collective queued on the stream, no host sync)."""
        if self.vocab_slice is None:
            return self.sampler.sample(logits, batch)
        if self.sampler.samples_slices(batch, logits.dtype, logits.device):
            return self.sampler.sample_slices(logits, batch, self.vocab_slice)
        output = self.sampler.sample(all_gather_vocab(logits, self.vocab_size), batch)
        broadcast_from_first(output.token_ids)
        return output

    @torch.inference_mode()
    def forward_logits(self, model_input: ModelInput, gather: bool = True) -> torch.Tensor | None:
        """Logits of the last token of each sampling chunk (None when no chunk samples); decode
        batches, and one sequence's prefill, run through a CUDA graph when one is captured.
        gather=False: under tensor parallelism, this rank's slice of them. model_input is on the
        runner's device (build_model_input)."""
        hidden = self._forward_input(model_input)
        if not model_input.sampled_chunks:
            return None
        return self.model.compute_logits(hidden[model_input.logits_indices], gather)

    def _forward_input(self, model_input: ModelInput) -> torch.Tensor:
        """Hidden states of every input token (of a CUDA graph's output buffer: valid until the next replay)."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not initialised (InitCache first)")
        self._fill_pending_tokens(model_input)
        return self._forward(model_input.input_ids, model_input.positions, model_input.metadata)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        for graphs in self.graphs:
            if graphs.can_run(metadata):
                return graphs.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, metadata)

    def _fill_pending_tokens(self, model_input: ModelInput) -> None:
        """Decode tokens sampled by steps still in flight come from those steps' device outputs:
        the copy is queued on the stream after them, so nothing waits on the host."""
        step_to_rows: dict[LaunchedStep, tuple[list[int], list[int]]] = {}
        for position, (step, row) in model_input.position_to_token_source.items():
            rows, positions = step_to_rows.setdefault(step, ([], []))
            rows.append(row)
            positions.append(position)
        for step, (rows, positions) in step_to_rows.items():
            index = host_to_device(torch.tensor([rows, positions], dtype=torch.int64), self.device)
            model_input.input_ids[index[1]] = step.device_token_ids[index[0]]


class HostTokens:
    """Sampled token ids on their way to the host: a non-blocking copy into pinned memory, read once
    the sampling that made them is done (not the work queued after it)."""

    def __init__(self, token_ids: torch.Tensor) -> None:
        self._event = None
        if token_ids.is_cuda:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = token_ids

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def _samples_differently(rows: SamplingRows, index: int) -> bool:
    """Whether iteration index of a multi-iteration decode step needs the batch rebuilt for its output
    indices: seeded rows draw from (seed, output index), which moves every iteration, and a min_tokens
    ban lifts at the iteration whose index reaches min_tokens."""
    return any(p.seed is not None or (p.min_tokens and first + index == p.min_tokens)
               for p, first in zip(rows.params, rows.output_index, strict=True))
