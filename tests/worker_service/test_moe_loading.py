"""Loading Qwen3-MoE checkpoints: HF's per-expert tensors and transformers' fused expert stacks into the
stacked experts, an error naming a missing expert tensor, each tensor-parallel rank holding its own
experts, and llama.cpp's qwen3moe GGUF files (stacked experts, router, metadata) giving the logits of
the safetensors load, also through the CPU int4 path (experts stay float32)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import make_tiny_checkpoint
from tests.worker_service.test_model_parity import PagedCache, random_tokens
from tests.worker_service.test_tp_sharding import load_as_rank
from worker_service.attention import get_attention_backend
from worker_service.loader import load_model
from worker_service.loader.model_loading import load_checkpoint
from worker_service.loader.quantized_cpu import Int4Linear
from worker_service.models.config import ModelConfig

gguf = pytest.importorskip("gguf")

NUM_EXPERTS = 8
# layers 0 and 2 sparse, layer 1 dense
SPEC: dict[str, Any] = dict(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, num_layers=3,
                            num_experts=NUM_EXPERTS, moe_intermediate_size=32, mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=11, **SPEC)


def parameters(path: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(path, torch.float32, "cpu", "torch")
    return dict(model.named_parameters())


def test_fused_expert_stacks_load_as_the_per_expert_tensors(checkpoint: Path, tmp_path: Path) -> None:
    """save_pretrained(save_original_format=False) writes transformers' own layout: the same parameters."""
    fused = make_tiny_checkpoint(tmp_path, "qwen3_moe", seed=11, save_original_format=False, **SPEC)
    names = set(load_file(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in set(load_file(checkpoint / "model.safetensors"))
    expected = parameters(checkpoint)
    got = parameters(fused)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_per_expert_tensors_fill_the_stacks(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "model.safetensors")
    params = parameters(checkpoint)
    gate_up = params["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[5, :32], tensors["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(gate_up[5, 32:], tensors["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(params["model.layers.2.mlp.experts.down_proj"][5],
                       tensors["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert torch.equal(params["model.layers.2.mlp.gate.weight"], tensors["model.layers.2.mlp.gate.weight"])
    assert "model.layers.1.mlp.gate_up_proj.weight" in params  # the dense layer


def without(checkpoint: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the checkpoint lacking one tensor."""
    folder = tmp_path / "incomplete"
    folder.mkdir()
    (folder / "config.json").write_text((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_a_missing_expert_tensor_is_named(checkpoint: Path, tmp_path: Path) -> None:
    folder = without(checkpoint, tmp_path, "model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"^1 model parameter\(s\) not found in the checkpoint: "
                                         r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight$"):
        load_model(folder, torch.float32, "cpu", "torch")


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_ranks_hold_their_experts(kind: str, checkpoint: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoint if kind == "safetensors" else write_qwen3moe_gguf(checkpoint, tmp_path / "moe.gguf")
    whole = load_as_rank(path, 0, 1, monkeypatch)
    for rank in range(2):
        part = load_as_rank(path, rank, 2, monkeypatch)
        experts = slice(4 * rank, 4 * (rank + 1))
        for layer in (0, 2):
            prefix = f"model.layers.{layer}.mlp"
            for name in ("experts.gate_up_proj", "experts.down_proj"):
                assert torch.equal(part[f"{prefix}.{name}"], whole[f"{prefix}.{name}"][experts])
            assert torch.equal(part[f"{prefix}.gate.weight"], whole[f"{prefix}.gate.weight"])  # replicated


def test_a_rank_still_needs_the_other_ranks_experts(checkpoint: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 keeps experts 4-7, yet a checkpoint without expert 0 is incomplete on it too."""
    folder = without(checkpoint, tmp_path, "model.layers.0.mlp.experts.0.down_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight"):
        load_as_rank(folder, 1, 2, monkeypatch)


# HF module name (after model.layers.N.) -> llama.cpp tensor name (after blk.N.)
_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def write_qwen3moe_gguf(folder: Path, path: Path, attention_type: int | None = None,
                        extra: dict[str, Any] | None = None) -> Path:
    """The HF checkpoint in folder as llama.cpp's qwen3moe GGUF: per-expert matrices stacked into
    blk.N.ffn_{gate,up,down}_exps (float32), MoE metadata as its converter writes it (no key for
    norm_topk_prob), the attention projections quantized to attention_type (float32 when None).
    extra: further qwen3moe.* float/bool keys."""
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in [("block_count", config["num_hidden_layers"]), ("context_length", 256),
                       ("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("attention.key_length", config["head_dim"]), ("expert_count", config["num_local_experts"]),
                       ("expert_used_count", config["num_experts_per_tok"]),
                       ("expert_feed_forward_length", config["moe_intermediate_size"])]:
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen3moe.rope.freq_base", 10000.0)
    for key, value in (extra or {}).items():
        (writer.add_bool if isinstance(value, bool) else writer.add_float32)(f"qwen3moe.{key}", value)
    tensors = load_file(folder / "model.safetensors")
    stacks: dict[str, dict[int, np.ndarray]] = {}  # GGUF name -> expert -> matrix
    for hf_name, tensor in tensors.items():
        array = tensor.numpy()
        if hf_name in _GLOBAL:
            writer.add_tensor(_GLOBAL[hf_name], array)
            continue
        layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        module, suffix = rest.rsplit(".", 1)
        if ".experts." in rest:  # mlp.experts.E.gate_proj.weight: stacked in expert order below
            expert, projection = module.removeprefix("mlp.experts.").split(".")
            stack = stacks.setdefault(f"blk.{layer}.ffn_{projection.removesuffix('_proj')}_exps.weight", {})
            stack[int(expert)] = array
            continue
        name = f"blk.{layer}.{_TO_GGUF[module]}.{suffix}"
        if attention_type is not None and module.startswith("self_attn.") and module.endswith("_proj"):
            writer.add_tensor(name, gguf.quantize(array, attention_type), raw_dtype=attention_type)
        else:
            writer.add_tensor(name, array)
    for name, matrices in stacks.items():
        writer.add_tensor(name, np.stack([matrices[expert] for expert in range(len(matrices))]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(path: Path, weight_format: str = "float32") -> tuple[torch.nn.Module, ModelConfig]:
    return load_checkpoint(str(path), torch.float32, torch.device("cpu"), get_attention_backend("torch"),
                           weight_format)


def logits_of(model: torch.nn.Module, tokens: list[int]) -> list[torch.Tensor]:
    """A 29-token prefill, then decode steps."""
    cache = PagedCache(model, seed=1)
    return [cache.step({0: tokens[:29]})[0], *(cache.step({0: [token]})[0] for token in tokens[29:])]


def test_gguf_gives_the_logits_of_safetensors(checkpoint: Path, tmp_path: Path) -> None:
    path = write_qwen3moe_gguf(checkpoint, tmp_path / "moe.gguf")
    ours, config = load(path)
    reference, hf_config = load(checkpoint)
    assert config == ModelConfig(**{**hf_config.__dict__, "max_position_embeddings": 256, "eos_token_ids": ()})
    assert config.norm_topk_prob and config.mlp_only_layers == (1,)  # no router in layer 1: dense
    tokens = random_tokens(36, config.vocab_size, seed=3)
    for got, expected in zip(logits_of(ours, tokens), logits_of(reference, tokens), strict=True):
        assert torch.equal(got, expected)


def test_gguf_routing_keys(checkpoint: Path, tmp_path: Path) -> None:
    """llama.cpp's qwen3moe always renormalises; an explicit expert_weights_norm is honoured; a scale is refused."""
    plain = load(write_qwen3moe_gguf(checkpoint, tmp_path / "plain.gguf"))[1]
    assert plain.norm_topk_prob
    raw = load(write_qwen3moe_gguf(checkpoint, tmp_path / "raw.gguf", extra={"expert_weights_norm": False}))[1]
    assert not raw.norm_topk_prob
    scaled = write_qwen3moe_gguf(checkpoint, tmp_path / "scaled.gguf", extra={"expert_weights_scale": 2.5})
    with pytest.raises(ValueError, match="expert_weights_scale"):
        load(scaled)


def test_cpu_int4_keeps_the_experts_dense(checkpoint: Path, tmp_path: Path) -> None:
    path = write_qwen3moe_gguf(checkpoint, tmp_path / "q4.gguf", attention_type=gguf.GGMLQuantizationType.Q4_0)
    dense, _ = load(path)
    model, _ = load(path, "int4")
    layers = model.model.layers
    assert all(isinstance(layer.self_attn.qkv_proj, Int4Linear) for layer in layers)
    assert isinstance(layers[0].mlp.experts.gate_up_proj, torch.nn.Parameter)  # float32 experts
    assert torch.equal(layers[0].mlp.experts.down_proj, dense.model.layers[0].mlp.experts.down_proj)
    tokens = random_tokens(36, 512, seed=4)
    for got, expected in zip(logits_of(model, tokens), logits_of(dense, tokens), strict=True):
        # decode steps take the int4 kernels (bfloat16 activations), prefill the float32 layers
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())
