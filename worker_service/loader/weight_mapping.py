"""The one place that maps HF checkpoint tensor names onto our parameters. Every checkpoint format
(safetensors, GGUF after renaming its tensors to HF names) loads through `load_named_tensor` and
finishes with `check_all_loaded`."""
from __future__ import annotations

import torch
from torch import nn

from worker_service.layers.linear import ShardId, loader_of

LoadedKey = tuple[str, ShardId]  # (our parameter name, shard id or None)

# HF projections that we fuse: name fragment -> (fused fragment, shard id in the fused weight).
_HF_TO_FUSED: dict[str, tuple[str, ShardId]] = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}
# Tensors some checkpoints carry that we recompute (rotary frequencies).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_name_to_param(hf_name: str) -> LoadedKey:
    """Our parameter name and shard id for an HF tensor name, e.g.
    "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k")."""
    for fragment, (fused, shard_id) in _HF_TO_FUSED.items():
        if fragment in hf_name:
            return hf_name.replace(fragment, fused), shard_id
    return hf_name, None


def is_ignored(model: nn.Module, hf_name: str) -> bool:
    """True for tensors that are not loaded: rotary buffers, and lm_head when tied to the embedding."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return True
    config = getattr(model, "config", None)
    return hf_name == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))


def load_named_tensor(model: nn.Module, hf_name: str, tensor: torch.Tensor) -> LoadedKey | None:
    """Copies one checkpoint tensor (HF name) into the model, casting to the parameter's dtype and
    device. Returns what was loaded, or None for an ignored tensor; raises KeyError for a name
    with no matching parameter and ValueError for a shape mismatch."""
    if is_ignored(model, hf_name):
        return None
    name, shard_id = hf_name_to_param(hf_name)
    try:
        param = model.get_parameter(name)
    except AttributeError:
        raise KeyError(f"checkpoint tensor {hf_name!r} matches no model parameter (looked for {name!r})") from None
    weight_loader, _ = loader_of(param)
    try:
        weight_loader(param, tensor, shard_id)
    except ValueError as error:
        raise ValueError(f"checkpoint tensor {hf_name!r}: {error}") from None
    return name, shard_id


def expected_keys(model: nn.Module) -> set[LoadedKey]:
    """Every (parameter, shard) that a complete checkpoint loads; a tied weight counts once."""
    return {(name, shard_id) for name, param in model.named_parameters() for shard_id in loader_of(param)[1]}


def check_all_loaded(model: nn.Module, loaded: set[LoadedKey]) -> None:
    """Raises ValueError naming every parameter (and shard) that no checkpoint tensor filled."""
    missing = expected_keys(model) - loaded
    if missing:
        listed = ", ".join(name if shard is None else f"{name}[{shard}]" for name, shard in sorted(missing, key=str))
        raise ValueError(f"{len(missing)} model parameter(s) not found in the checkpoint: {listed}")
