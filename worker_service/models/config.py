"""The project's own model configuration, converted once from a Hugging Face config.json (or from
GGUF metadata) at the edge; layers and models read only this."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_service.layers.rotary import RopeScaling

# HF model_type -> our architecture (the key of worker_service.models' class table).
MODEL_TYPE_TO_ARCHITECTURE = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "mistral": "llama",
                              "qwen3_moe": "qwen3_moe"}
MOE_ARCHITECTURES = frozenset({"qwen3_moe"})


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
    # Mixture of experts (qwen3_moe; 0 experts: every layer dense). A sparse layer routes each token to
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size; the others are dense MLPs of
    # intermediate_size. Which layers are sparse follows HF: see is_moe_layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def has_qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "qwen3_moe")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer index has a sparse MoE block (else a dense MLP), by HF's rule: every
        decoder_sparse_step-th layer (counting from 1), except those in mlp_only_layers."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def __post_init__(self) -> None:
        if self.architecture not in MODEL_TYPE_TO_ARCHITECTURE.values():
            raise ValueError(f"architecture {self.architecture!r} is not supported")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self._check_experts()

    def _check_experts(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts {self.num_experts} is negative")
        if self.num_experts == 0:
            return
        if self.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"num_experts: architecture {self.architecture!r} has no experts")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be between 1 and "
                             f"num_experts {self.num_experts}")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size {self.moe_intermediate_size} must be positive")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step {self.decoder_sparse_step} must be at least 1")
        outside = [index for index in self.mlp_only_layers if not 0 <= index < self.num_layers]
        if outside:
            raise ValueError(f"mlp_only_layers {list(self.mlp_only_layers)}: {outside} outside the "
                             f"{self.num_layers} layers")

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
            **_experts_from_hf(hf, architecture),
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))


def _experts_from_hf(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The MoE fields of an HF config, with Qwen3MoeConfig's defaults for absent keys (a dense
    architecture: none). The saved config.json names the expert count num_experts or, as
    transformers 5 writes it, num_local_experts."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    return dict(
        num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 128))),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(index) for index in hf.get("mlp_only_layers") or ()),
    )


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
