"""The one place that maps HF checkpoint tensor names onto our parameters. Every checkpoint format
(safetensors, GGUF after renaming its tensors to HF names) loads through `load_named_tensor` and
finishes with `check_all_loaded`.

MoE experts: HF checkpoints (the Hub's Qwen3-MoE ones, and what transformers 5's save_pretrained writes
by default) hold one matrix per expert and projection, `model.layers.N.mlp.experts.E.gate_proj.weight`
(`up_proj`, `down_proj`); they load into the stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`
as shard (E, "gate" | "up" | "down"). transformers' own fused layout (save_pretrained with
save_original_format=False), `mlp.experts.gate_up_proj` [E, 2 I, H] and `mlp.experts.down_proj` [E, H, I]
without a `.weight`, is cut into the same per-expert shards here.
"""
from __future__ import annotations

import re

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
# One expert's projection, and transformers' fused stack of all experts' projections.
_EXPERT_TENSOR = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight")
_FUSED_EXPERTS = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)")
_PART_TO_PARAM = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}
# Tensors some checkpoints carry that we recompute (rotary frequencies).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_name_to_param(hf_name: str) -> LoadedKey:
    """Our parameter name and shard id for an HF tensor name, e.g.
    "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight", "k"),
    "model.layers.0.mlp.experts.5.up_proj.weight" -> ("model.layers.0.mlp.experts.gate_up_proj", (5, "up"))."""
    expert = _EXPERT_TENSOR.fullmatch(hf_name)
    if expert is not None:
        part = expert["part"]
        return f"{expert['experts']}.{_PART_TO_PARAM[part]}", (int(expert["expert"]), part)
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


def split_fused_experts(hf_name: str, tensor: torch.Tensor) -> list[tuple[LoadedKey, torch.Tensor]] | None:
    """transformers' fused expert stack as (our parameter, (expert, part)) shards and their matrices;
    None for any other tensor."""
    match = _FUSED_EXPERTS.fullmatch(hf_name)
    if match is None:
        return None
    if tensor.ndim != 3 or (match["param"] == "gate_up_proj" and tensor.shape[1] % 2):
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, not a stack of experts")
    name = f"{match['experts']}.{match['param']}"
    if match["param"] == "down_proj":
        return [((name, (expert, "down")), matrix) for expert, matrix in enumerate(tensor)]
    return [((name, (expert, part)), half) for expert, matrix in enumerate(tensor)
            for part, half in zip(("gate", "up"), matrix.chunk(2), strict=True)]


def load_named_tensor(model: nn.Module, hf_name: str, tensor: torch.Tensor) -> list[LoadedKey]:
    """Copies one checkpoint tensor (HF name) into the model, casting to the parameter's dtype and
    device. Returns what was loaded (one key; one per expert and part for a fused expert stack; none
    for an ignored tensor); raises KeyError for a name with no matching parameter and ValueError for
    a shape mismatch."""
    if is_ignored(model, hf_name):
        return []
    shards = split_fused_experts(hf_name, tensor)
    if shards is None:
        shards = [(hf_name_to_param(hf_name), tensor)]
    for (name, shard_id), piece in shards:
        try:
            param = model.get_parameter(name)
        except AttributeError:
            raise KeyError(f"checkpoint tensor {hf_name!r} matches no model parameter (looked for {name!r})") from None
        weight_loader, _ = loader_of(param)
        try:
            weight_loader(param, piece, shard_id)
        except ValueError as error:
            raise ValueError(f"checkpoint tensor {hf_name!r}: {error}") from None
    return [key for key, _ in shards]


def expected_keys(model: nn.Module) -> set[LoadedKey]:
    """Every (parameter, shard) that a complete checkpoint loads; a tied weight counts once."""
    return {(name, shard_id) for name, param in model.named_parameters() for shard_id in loader_of(param)[1]}


def check_all_loaded(model: nn.Module, loaded: set[LoadedKey], max_listed: int = 20) -> None:
    """Raises ValueError naming the parameters (and shards) that no checkpoint tensor filled: the
    first max_listed of them (a model of 128 experts a layer misses thousands when one layer is gone)."""
    missing = sorted(expected_keys(model) - loaded, key=str)
    if missing:
        listed = ", ".join(_describe(name, shard) for name, shard in missing[:max_listed])
        more = f" and {len(missing) - max_listed} more" if len(missing) > max_listed else ""
        raise ValueError(f"{len(missing)} model parameter(s) not found in the checkpoint: {listed}{more}")


def _describe(name: str, shard: ShardId) -> str:
    """A missing key as the checkpoint would name it: an expert's HF tensor, else our parameter[shard]."""
    if isinstance(shard, tuple):
        expert, part = shard
        return f"{name.rsplit('.', 1)[0]}.{expert}.{part}_proj.weight"
    return name if shard is None else f"{name}[{shard}]"
