"""A randomly initialised checkpoint of Qwen3-0.6B's (or Qwen3-8B's) shapes (config.json +
safetensors, bf16), for speed measurements where no weights can be downloaded: with EOS ignored
the work is the same. Qwen3-30B-A3B's is a random checkpoint the worker draws in memory
(worker_service/loader/random_weights): `random_model_folder` picks the kind by name."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker_service.loader.random_weights import hf_tensor_shapes, write_random_checkpoint
from worker_service.models.config import ModelConfig

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 151645, "bos_token_id": 151643,
}

# Qwen3-8B's shapes (untied embeddings): 8.2 B parameters, 16.4 GB in bf16.
QWEN3_8B = QWEN3_0_6B | {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "tie_word_embeddings": False,
}
# Qwen3-30B-A3B's shapes (its public config): 48 layers of 128 experts (8 active) of intermediate 768,
# 30.5 B parameters, 61 GB in bf16. Drawn in memory on the device (random_weights), not written.
QWEN3_30B_A3B = QWEN3_0_6B | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}
RANDOM_MODELS = {"random-qwen3-0.6b": QWEN3_0_6B, "random-qwen3-8b": QWEN3_8B, "random-qwen3-30b-a3b": QWEN3_30B_A3B}
IN_MEMORY = {"random-qwen3-30b-a3b"}  # too large to write in a benchmark's time: drawn where loaded


def random_model_folder(work_dir: Path, name: str) -> Path:
    """The checkpoint folder of RANDOM_MODELS[name] under work_dir, made once."""
    if name in IN_MEMORY:
        folder = work_dir / name
        if not (folder / "config.json").exists():
            write_random_checkpoint(folder, RANDOM_MODELS[name])
        return folder
    return make_random_checkpoint(work_dir / name, RANDOM_MODELS[name])


def make_random_checkpoint(folder: Path, config: dict | None = None, seed: int = 0) -> Path:
    """Writes the checkpoint once; an existing one is reused. Large models are drawn on the GPU
    when there is one (minutes on a CPU for 8 B parameters) and saved in ~2 GB files."""
    config = config or QWEN3_0_6B
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "config.json").exists():
        return folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    num_files, file_bytes = 0, 0
    names = list(hf_tensor_shapes(ModelConfig.from_hf_dict(config)).items())
    for index, (name, shape) in enumerate(names):
        if len(shape) == 1:  # norm weights
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            drawn = torch.randn(shape, generator=generator, device=device) * 0.02
            tensors[name] = drawn.to(torch.bfloat16).cpu()
        file_bytes += tensors[name].numel() * 2
        if file_bytes >= 2 << 30 or index == len(names) - 1:
            is_single = num_files == 0 and index == len(names) - 1
            file_name = "model.safetensors" if is_single else f"model-{num_files:05d}.safetensors"
            save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
            tensors, num_files, file_bytes = {}, num_files + 1, 0
    if device == "cuda":
        torch.cuda.empty_cache()  # the benchmark's workers measure free GPU memory next
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # last: marks the checkpoint complete
    return folder
