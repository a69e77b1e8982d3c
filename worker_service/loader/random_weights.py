"""Random weights of a model's real shapes, drawn on the device instead of read from files: for speed
measurements where no weights can be downloaded and writing a large checkpoint would cost more than
the measurement (Qwen3-30B-A3B: 61 GB). With EOS ignored the work is the same as with real weights.

A random checkpoint is a folder with the model's config.json and RANDOM_WEIGHTS_FILE (JSON: seed,
std) instead of safetensors. Its tensors carry HF names and shapes (`hf_tensor_shapes`) and load
through the same name mapping and weight loaders as a file's (safetensors_loader.load_hf_weights);
only the read is replaced by a draw. Norm weights are ones, every other tensor N(0, std).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from worker_service.models.config import ModelConfig

RANDOM_WEIGHTS_FILE = "random-weights.json"


def is_random_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / RANDOM_WEIGHTS_FILE).is_file()


def write_random_checkpoint(folder: str | Path, hf_config: dict, seed: int = 0, std: float = 0.02) -> Path:
    """The folder of a random checkpoint of hf_config (config.json last: it marks the folder complete)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed, "std": std}))
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    return folder


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor of a checkpoint of config (llama, qwen2, qwen3, qwen3_moe)."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        shapes |= _attention_shapes(f"{prefix}.self_attn", config)
        shapes |= {f"{prefix}.{norm}.weight": (hidden,) for norm in ("input_layernorm", "post_attention_layernorm")}
        if config.is_moe_layer(layer):
            shapes[f"{prefix}.mlp.gate.weight"] = (config.num_experts, hidden)
            for expert in range(config.num_experts):
                shapes |= _mlp_shapes(f"{prefix}.mlp.experts.{expert}", hidden, config.moe_intermediate_size)
        else:
            shapes |= _mlp_shapes(f"{prefix}.mlp", hidden, config.intermediate_size)
    return shapes


def _attention_shapes(prefix: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes = {f"{prefix}.q_proj.weight": (q_size, hidden), f"{prefix}.k_proj.weight": (kv_size, hidden),
              f"{prefix}.v_proj.weight": (kv_size, hidden), f"{prefix}.o_proj.weight": (hidden, q_size)}
    if config.attention_bias:
        shapes |= {f"{prefix}.q_proj.bias": (q_size,), f"{prefix}.k_proj.bias": (kv_size,),
                   f"{prefix}.v_proj.bias": (kv_size,)}
        if config.architecture != "qwen2":
            shapes[f"{prefix}.o_proj.bias"] = (hidden,)
    if config.has_qk_norm:
        shapes |= {f"{prefix}.q_norm.weight": (head_dim,), f"{prefix}.k_norm.weight": (head_dim,)}
    return shapes


def _mlp_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (intermediate, hidden), f"{prefix}.up_proj.weight": (intermediate, hidden),
            f"{prefix}.down_proj.weight": (hidden, intermediate)}


def iter_random_tensors(folder: str | Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor on device) for every tensor of the random checkpoint in folder, drawn from its
    seed in name order (the same weights on every rank and every run)."""
    params = json.loads((Path(folder) / RANDOM_WEIGHTS_FILE).read_text())
    std = float(params.get("std", 0.02))
    generator = torch.Generator(device).manual_seed(int(params.get("seed", 0)))
    for name, shape in hf_tensor_shapes(ModelConfig.from_hf_folder(folder)).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.randn(shape, generator=generator, device=device) * std
