"""Qwen3-MoE (e.g. Qwen3-30B-A3B): the Qwen3 decoder with sparse MoE blocks in place of the MLPs of the
layers ModelConfig.is_moe_layer names.

The shared `DecoderLayer` builds a SparseMoeBlock (worker_service.layers.moe) or an MLP per layer and the
attention is Qwen3's (per-head q/k norms), so this class only pins the architecture.
"""
from __future__ import annotations

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelConfig
from worker_service.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 MoE models; same interface as LlamaForCausalLM."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        if config.architecture != "qwen3_moe":
            raise ValueError(f"Qwen3MoeForCausalLM needs a qwen3_moe config, got {config.architecture!r}")
        super().__init__(config, backend)
