"""A randomly initialised checkpoint of Qwen3-0.6B's shapes (config.json + safetensors, bf16), for
speed measurements where no weights can be downloaded: with EOS ignored the work is the same."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 151645, "bos_token_id": 151643,
}


def qwen3_tensors(config: dict, std: float = 0.02) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,),
            f"{prefix}.mlp.gate_proj.weight": (inter, hidden),
            f"{prefix}.mlp.up_proj.weight": (inter, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inter),
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def make_random_checkpoint(folder: Path, config: dict | None = None, seed: int = 0) -> Path:
    """Writes the checkpoint once; an existing one is reused."""
    config = config or QWEN3_0_6B
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "model.safetensors").exists():
        return folder
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in qwen3_tensors(config).items():
        if len(shape) == 1:  # norm weights
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
