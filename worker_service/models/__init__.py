"""Model classes, chosen by ModelConfig.architecture."""
from __future__ import annotations

from worker_service.attention.base import AttentionBackend
from worker_service.models.config import ModelConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.qwen3 import Qwen3ForCausalLM
from worker_service.models.qwen3_moe import Qwen3MoeForCausalLM

_ARCHITECTURE_TO_CLASS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # llama with q/k/v biases, switched on by config.attention_bias
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

__all__ = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "build_model"]


def build_model(config: ModelConfig, backend: AttentionBackend) -> LlamaForCausalLM:
    """An uninitialised model for config, created on the current default device and dtype (wrap the
    call in `torch.device(...)` and set the default dtype to build in place, as load_model does)."""
    model_class = _ARCHITECTURE_TO_CLASS.get(config.architecture)
    if model_class is None:
        raise ValueError(f"no model for architecture {config.architecture!r}")
    return model_class(config, backend)
