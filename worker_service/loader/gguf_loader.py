"""Loading GGUF checkpoints (llama.cpp's format): the project's ModelConfig from GGUF metadata, and the weights
as Hugging Face-named float32 tensors in HF layout, ready for the same name mapping as safetensors weights.

qwen3moe files stack each layer's experts in one 3-D tensor per projection (`blk.N.ffn_gate_exps.weight`
[E, I, H] row-major, `ffn_up_exps`, `ffn_down_exps` [E, H, I]); they are yielded as HF's per-expert
matrices (`model.layers.N.mlp.experts.E.gate_proj.weight`, ...). The router is `blk.N.ffn_gate_inp.weight`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from common.formats.gguf_file import GGUFFile
from worker_service.layers.rotary import RopeScaling
from worker_service.loader.gguf_dequant import dequantize_tensor
from worker_service.models.config import ModelConfig

_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

# GGUF tensor name -> HF name (the standardized names of gguf's tensor_mapping, for the supported models)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# stacked experts: GGUF block tensor -> the HF projection of each expert
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# tensors llama.cpp adds that have no HF counterpart: rope_freqs is read into the config (llama3 rope scaling)
_IGNORED = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight")


def gguf_model_config(source: str | Path | GGUFFile) -> ModelConfig:
    """Builds the project's ModelConfig from a GGUF file's metadata (and its tensor shapes where the
    metadata is silent)."""
    return _model_config(_open(source))


def _open(source: str | Path | GGUFFile) -> GGUFFile:
    """Parsing the header takes a while on a large vocabulary: a loader parses it once and passes the file."""
    return source if isinstance(source, GGUFFile) else GGUFFile(source)


def _model_config(gguf: GGUFFile) -> ModelConfig:
    meta, arch = gguf.metadata, _architecture(gguf)

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if isinstance(value, np.ndarray):  # per-layer values (hybrid models): only uniform ones are supported
            if value.size == 0 or (value != value.flat[0]).any():
                raise ValueError(f"{gguf.path}: {arch}.{key} varies per layer ({value.tolist()}), not supported")
            value = value.flat[0].item()
        return value

    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    hidden_size = int(get("embedding_length"))
    rope_theta = _float32_value(get("rope.freq_base", 10000.0))
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        vocab_size=gguf.tensors["token_embd.weight"].ggml_shape[1],
        hidden_size=hidden_size,
        intermediate_size=int(get("feed_forward_length", get("expert_feed_forward_length"))),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=_head_dim(gguf, get("attention.key_length"), num_heads, hidden_size),
        rms_norm_eps=_float32_value(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        rope_scaling=_rope_scaling(gguf, get, rope_theta),
        eos_token_ids=_eos_token_ids(meta),
        **_experts(gguf, get),
    )


def _experts(gguf: GGUFFile, get: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The MoE fields of ModelConfig for a file with experts (none for a dense one).

    norm_topk_prob: llama.cpp's qwen3moe graph always renormalises the chosen experts' weights
    (build_moe_ffn with norm_w = true, whatever the HF config said), and its converter writes no key for
    it; so True, unless the file carries `expert_weights_norm` (the key llama.cpp reads for this in other
    MoE architectures). A layer without a router (`ffn_gate_inp`) is taken as dense; llama.cpp's qwen3moe
    has a router in every layer.
    """
    num_experts = int(get("expert_count", 0))
    if not num_experts:
        return {}
    if float(get("expert_weights_scale", 0.0)) not in (0.0, 1.0):
        raise ValueError(f"{gguf.path}: scaled expert weights (expert_weights_scale) are not supported")
    gate_stack = next((info for name, info in gguf.tensors.items() if name.endswith(".ffn_gate_exps.weight")), None)
    moe_size = get("expert_feed_forward_length") or (gate_stack.ggml_shape[1] if gate_stack is not None else 0)
    num_layers = int(get("block_count"))
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(get("expert_used_count", 0)),
        moe_intermediate_size=int(moe_size),
        norm_topk_prob=bool(get("expert_weights_norm", True)),
        mlp_only_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors),
    )


def iter_gguf_hf_tensors(source: str | Path | GGUFFile) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF parameter name, float32 array in HF layout) for every weight of a GGUF file, in file order.

    Dequantizes one tensor at a time (a stack of experts at once, yielded as one matrix per expert). For llama
    files the q/k projection rows are put back in HF order (llama.cpp's converter interleaves the two rotary
    halves of each head). No lm_head.weight is yielded when the embeddings are tied (the file has no
    output.weight).
    """
    gguf = _open(source)
    config = _model_config(gguf)
    is_permuted = config.architecture == "llama"
    for gguf_name in gguf.tensors:
        expert_names = gguf_expert_hf_names(gguf_name, config.num_experts)
        if expert_names is not None:
            stack = dequantize_tensor(gguf, gguf_name)
            if stack.ndim != 3 or stack.shape[0] != len(expert_names):
                raise ValueError(f"GGUF tensor {gguf_name!r} has shape {stack.shape}, not {len(expert_names)} experts")
            yield from zip(expert_names, stack, strict=True)
            continue
        hf_name = gguf_to_hf_name(gguf_name)
        if hf_name is None:
            continue
        tensor = dequantize_tensor(gguf, gguf_name)
        if is_permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_rotary_rows(tensor, config.num_heads)
        elif is_permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_rotary_rows(tensor, config.num_kv_heads)
        yield hf_name, tensor


def gguf_expert_hf_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The HF names of the experts' matrices stacked in a GGUF tensor, in stack order; None for other tensors."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _EXPERT_STACKS or match[3] != "weight":
        return None
    return [f"model.layers.{match[1]}.mlp.experts.{e}.{_EXPERT_STACKS[match[2]]}.weight" for e in range(num_experts)]


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors that have no HF counterpart. (Stacked
    experts have several: gguf_expert_hf_names.)"""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if _IGNORED.fullmatch(gguf_name):
        return None
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF counterpart")
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


def unpermute_rotary_rows(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes convert_hf_to_gguf's llama q/k permutation: per head GGUF row 2*i + s is HF row s*half + i."""
    head_dim = tensor.shape[0] // num_heads
    rows = tensor.reshape(num_heads, head_dim // 2, 2, *tensor.shape[1:])
    return np.ascontiguousarray(rows.swapaxes(1, 2)).reshape(tensor.shape)


def _architecture(gguf: GGUFFile) -> str:
    arch = gguf.metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{gguf.path}: GGUF architecture {arch!r} is not one of {list(_ARCHITECTURES)}")
    return arch


def _float32_value(value: float) -> float:
    """GGUF stores float32: 1e-5 arrives as 9.99999974e-06. Take the shortest decimal that rounds to it."""
    return float(str(np.float32(value)))


def _head_dim(gguf: GGUFFile, key_length: int | None, num_heads: int, hidden_size: int) -> int:
    if key_length:
        return int(key_length)
    q_proj = gguf.tensors.get("blk.0.attn_q.weight")
    return q_proj.ggml_shape[1] // num_heads if q_proj is not None else hidden_size // num_heads


def _eos_token_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """eos, then end-of-turn / end-of-message ids (llama.cpp stops on all of them)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta and int(meta[key]) not in ids:
            ids.append(int(meta[key]))
    return tuple(ids)


def _rope_scaling(gguf: GGUFFile, get: Callable[[str, Any], Any], rope_theta: float) -> RopeScaling:
    kind = get("rope.scaling.type", "none")
    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 1.0)))
    if "rope_freqs.weight" in gguf.tensors:
        return _llama3_rope_scaling(dequantize_tensor(gguf, "rope_freqs.weight"), rope_theta)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    raise ValueError(f"{gguf.path}: rope scaling {kind!r} is not supported")


def _llama3_rope_scaling(freq_divisors: np.ndarray, rope_theta: float) -> RopeScaling:
    """Recovers HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor (per-frequency divisors).

    Only the wavelength thresholds original / low_freq_factor and original / high_freq_factor are identifiable,
    so low_freq_factor = 1 and high_freq_factor = 4 (every Llama 3.x release) are assumed and the original
    context length is fitted; the divisors rebuilt from the result must match the tensor.
    """
    factor = _float32_value(float(freq_divisors.max()))
    head_dim = 2 * freq_divisors.size
    wavelens = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low, high = 1.0, 4.0
    mixed = (freq_divisors > 1 + 1e-6) & (freq_divisors < factor - 1e-6)
    original = 8192
    if factor > 1 and mixed.any():
        smooth = (1 / freq_divisors[mixed] - 1 / factor) / (1 - 1 / factor)
        original = int(round(float(np.median((smooth * (high - low) + low) * wavelens[mixed]))))
    scaling = RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )
    rebuilt = llama3_rope_divisors(scaling, wavelens)
    if not np.allclose(rebuilt, freq_divisors, rtol=1e-4):
        raise ValueError("rope_freqs.weight does not match llama3 rope scaling with low/high freq factors 1 and 4")
    return scaling


def llama3_rope_divisors(scaling: RopeScaling, wavelens: np.ndarray) -> np.ndarray:
    """Per-frequency divisors of llama3 rope scaling (what llama.cpp stores as rope_freqs.weight)."""
    original = scaling.original_max_position_embeddings or 8192
    low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    smooth = (original / wavelens - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    mixed = 1 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelens < high_wavelen, 1.0, np.where(wavelens > low_wavelen, scaling.factor, mixed))
