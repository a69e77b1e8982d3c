"""Qwen3: the Llama decoder plus an RMSNorm over each head of q and k, applied before rotary.

The norms live in the shared `Attention` module (switched on by ModelConfig.has_qk_norm), so this
class only pins the architecture.
"""
from __future__ import annotations

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelConfig
from worker_service.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (e.g. Qwen3-0.6B); same interface as LlamaForCausalLM."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        if not config.has_qk_norm:
            raise ValueError(f"Qwen3ForCausalLM needs a qwen3 config, got {config.architecture!r}")
        super().__init__(config, backend)
