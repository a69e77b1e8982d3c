"""Holds the model and its paged KV cache; runs one forward pass and samples."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.contract.config import WorkerConfig
from common.formats.checkpoint import find_gguf_file
from worker_service.attention import default_backend_name, get_attention_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.attention.kv_quant import SCALE_DTYPE, allocate_scales, is_fp8, kv_cache_torch_dtype
from worker_service.loader.cpu_quantization import resolve_cpu_weight_format
from worker_service.loader.model_loading import load_checkpoint
from worker_service.parallel.distributed import (
    all_gather_vocab,
    broadcast_from_first,
    init_symmetric_sum,
    min_over_ranks,
    tp_rank,
    tp_size,
)
from worker_service.runtime.batch import ModelInput, build_model_input, sampling_rows
from worker_service.runtime.cuda_graphs import DecodeGraphs, PrefillGraphs
from worker_service.runtime.decode_plan import DecodePlan
from worker_service.runtime.memory_profile import HEAVIEST_SAMPLING, PLAIN_SAMPLING, warmup_chunks
from worker_service.runtime.sequence_state import InFlightStep
from worker_service.sampling.sampler import Sampler, SamplerOutput, stack_iterations
from worker_service.sampling.sampling_state import SamplingBatch, host_to_device
from worker_service.sampling.vocab_parallel import VocabSlice

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of a rank: with tensor parallelism rank r takes the r-th visible GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and world_size > 1:
        return torch.device("cuda", rank)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V, plus with an fp8 cache one float32 scale per head vector (kv_quant)."""
        vector_bytes = self.head_dim * self.dtype.itemsize + (SCALE_DTYPE.itemsize if is_fp8(self.dtype) else 0)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * vector_bytes


class ModelRunner:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device, tp_rank(), tp_size())
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.weight_format = resolve_cpu_weight_format(config.cpu_weight_format, self.device.type,
                                                       find_gguf_file(Path(config.model)) is not None,
                                                       config.tensor_parallel_size)
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = default_backend_name(self.device, is_quantized=self.weight_format != "float32")
        self.backend = get_attention_backend(backend_name)
        self.model, self.model_config = load_checkpoint(config.model, self.dtype, self.device, self.backend,
                                                        self.weight_format)
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
    def model_name(self) -> str:
        return self.config.model

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # KV cache.

    def available_kv_blocks(self) -> int:
        """Blocks that fit in the memory budget (or the configured override). On a GPU the budget is
        gpu_memory_utilization of the device, less what other processes hold and the peak of a
        warm-up step of the largest size the worker serves (weights and activations). Under tensor
        parallelism every rank calls this once, together: the group takes its smallest rank's."""
        if self._available_blocks is None:
            if self.config.num_kv_blocks:
                blocks = self.config.num_kv_blocks
            elif self.device.type == "cuda":
                blocks = self._gpu_kv_budget() // self.kv_spec.bytes_per_block
            else:
                blocks = self.config.cpu_kv_cache_bytes // self.kv_spec.bytes_per_block
            self._available_blocks = min_over_ranks(blocks, self.device)
        return max(self._available_blocks, 0)

    def _gpu_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        peak = self._warmup_peak_memory()
        # CUDA graphs and the allocator's fragmentation take a little more than the warm-up shows.
        margin = 512 * 2**20
        budget = int(total * self.config.gpu_memory_utilization) - used_by_others - peak - margin
        logger.info("GPU memory: %.1f GiB total, %.1f GiB used by others, %.2f GiB peak of a warm-up step; "
                    "%.1f GiB for the KV cache", total / 2**30, used_by_others / 2**30, peak / 2**30, budget / 2**30)
        return budget

    def _warmup_peak_memory(self) -> int:
        """Peak bytes torch allocates in a warm-up step of the largest size the worker serves (see
        memory_profile), without its temporary cache. A second, small step compiles the fused
        sampling kernel, so that no request waits for that."""
        config = self.config
        chunks = warmup_chunks(config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                               HEAVIEST_SAMPLING)
        num_blocks = sum(len(c.state.block_table) for c in chunks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.init_cache(num_blocks, capture_graphs=False)
        self.run(build_model_input(chunks, config.block_size))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - num_blocks * self.kv_spec.bytes_per_block
        plain = warmup_chunks(2, min(2, num_blocks), config.block_size, PLAIN_SAMPLING)
        self.run(build_model_input(plain, config.block_size))
        torch.cuda.synchronize(self.device)
        self.release_cache()
        torch.cuda.empty_cache()
        return peak

    def release_cache(self) -> None:
        """Drops the graphs and every reference to the cache (the layers' views too), so that its
        memory can hold the next one: a second InitCache (a scheduler taking the worker over) needs it."""
        self.graphs = []
        self.kv_cache = None
        self.kv_scales = None
        self._attach_cache()
        self.num_kv_blocks = 0

    def _attach_cache(self) -> None:
        """Points each attention layer at its slice of the cache (at nothing when there is none)."""
        for layer_index, attention in enumerate(self.model.attention_layers()):
            caches = self.kv_cache[layer_index] if self.kv_cache is not None else (torch.empty(0), torch.empty(0))
            attention.k_cache, attention.v_cache = caches[0], caches[1]
            scales = self.kv_scales[layer_index] if self.kv_scales is not None else (None, None)
            attention.k_scale, attention.v_scale = scales[0], scales[1]

    def init_cache(self, num_blocks: int, capture_graphs: bool = True) -> int:
        spec = self.kv_spec
        self.release_cache()  # before allocating: the old cache's memory may be needed for the new one
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the old graphs' pool and a cache of another size: back to the device
        # Every slot is written before it is read; zeros on the CPU only keep stray reads finite.
        allocate = torch.empty if self.device.type == "cuda" else torch.zeros
        self.kv_cache = allocate((spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
                                 dtype=spec.dtype, device=self.device)
        if is_fp8(spec.dtype):
            self.kv_scales = allocate_scales(allocate, (spec.num_layers, 2, num_blocks), spec.block_size,
                                             spec.num_kv_heads, self.device)
        self._attach_cache()
        self.num_kv_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, spec.block_size,
                    num_blocks * spec.bytes_per_block / 2**20)
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
    def run(self, model_input: ModelInput, num_steps: int = 1) -> SamplerOutput | None:
        """Runs the batch and samples; outputs are [num_seqs, num_steps] (None when no chunk samples).
        With num_steps > 1 the batch must be decode-only: each iteration feeds the tokens the previous
        one sampled, without the host in between."""
        metadata = model_input.metadata
        # Before the forward pass moves the metadata to the device: the plan reads the block tables.
        plan = DecodePlan.build(model_input, num_steps, self.config.block_size, self.device) if num_steps > 1 else None
        gather = self.vocab_slice is None  # under tensor parallelism each rank keeps its slice (_sample)
        logits = self.forward_logits(model_input, gather)
        if logits is None:
            return None
        # Host work after the forward pass is launched, so that it overlaps the GPU's.
        rows = sampling_rows(model_input.sampled_chunks)
        batch = SamplingBatch.build(rows, self.vocab_size, self.device)
        outputs = [self._sample(logits, batch)]
        any_seeded = num_steps > 1 and any(p.seed is not None for p in rows.params)
        for index in range(1, num_steps):
            assert plan is not None
            plan.advance(metadata, index)
            hidden = self._forward(outputs[-1].token_ids, plan.positions[index], metadata)
            logits = self.model.compute_logits(hidden, gather)
            if any_seeded:
                # Seeded rows draw from (seed, output index): the index moves every iteration.
                step_rows = replace(rows, output_index=[i + index for i in rows.output_index])
                batch = SamplingBatch.build(step_rows, self.vocab_size, self.device)
            outputs.append(self._sample(logits, batch))
        return stack_iterations(outputs)

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
        gather=False: under tensor parallelism, this rank's slice of them."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is not initialised (InitCache first)")
        model_input = self._to_device(model_input)
        self._fill_pending_tokens(model_input)
        hidden = self._forward(model_input.input_ids, model_input.positions, model_input.metadata)
        if not model_input.sampled_chunks:
            return None
        return self.model.compute_logits(hidden[model_input.logits_indices], gather)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        for graphs in self.graphs:
            if graphs.can_run(metadata):
                return graphs.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, metadata)

    def _fill_pending_tokens(self, model_input: ModelInput) -> None:
        """Decode tokens sampled by steps still in flight come from those steps' device outputs:
        the copy is queued on the stream after them, so nothing waits on the host."""
        step_to_rows: dict[InFlightStep, tuple[list[int], list[int]]] = {}
        for position, (step, row) in model_input.position_to_token_source.items():
            rows, positions = step_to_rows.setdefault(step, ([], []))
            rows.append(row)
            positions.append(position)
        for step, (rows, positions) in step_to_rows.items():
            index = host_to_device(torch.tensor([rows, positions], dtype=torch.int64), self.device)
            model_input.input_ids[index[1]] = step.device_token_ids[index[0]]

    def _to_device(self, model_input: ModelInput) -> ModelInput:
        if self.device.type == "cpu":
            return model_input
        md = model_input.metadata
        move = lambda t: host_to_device(t, self.device)  # noqa: E731
        md.slot_mapping, md.query_start_loc = move(md.slot_mapping), move(md.query_start_loc)
        md.seq_lens, md.block_tables = move(md.seq_lens), move(md.block_tables)
        model_input.input_ids, model_input.positions = move(model_input.input_ids), move(model_input.positions)
        model_input.logits_indices = move(model_input.logits_indices)
        return model_input
