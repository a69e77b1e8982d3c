"""The project's own model configuration, converted once from a Hugging Face config.json (or from
GGUF metadata) at the edge; layers and models read only this."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_service.layers.rotary import RopeScaling

# HF model_type -> our architecture (the key of worker_service.models' class table).
MODEL_TYPE_TO_ARCHITECTURE = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "mistral": "llama"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of MODEL_TYPE_TO_ARCHITECTURE's values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # qwen2 has q/k/v biases
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def has_qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    def __post_init__(self) -> None:
        if self.architecture not in MODEL_TYPE_TO_ARCHITECTURE.values():
            raise ValueError(f"architecture {self.architecture!r} is not supported")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "")
        architecture = MODEL_TYPE_TO_ARCHITECTURE.get(model_type)
        if architecture is None:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: "
                             f"{', '.join(MODEL_TYPE_TO_ARCHITECTURE)})")
        num_heads = hf["num_attention_heads"]
        hidden_size = hf["hidden_size"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope = _rope_scaling_from_hf(hf)
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope[1],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", architecture == "qwen2"),
            rope_scaling=rope[0],
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))


def _rope_scaling_from_hf(hf: dict[str, Any]) -> tuple[RopeScaling, float]:
    """Reads rope_scaling (or transformers 5's rope_parameters) and rope_theta."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params or {}
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "linear", "dynamic", "llama3"):
        raise ValueError(f"rope_scaling type {kind!r} is not supported")
    return (
        RopeScaling(
            kind=kind,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=scaling.get("original_max_position_embeddings"),
        ),
        theta,
    )
