"""The loader under tensor parallelism: each rank keeps its slice of every tensor of a safetensors
or GGUF checkpoint, and the slices of all ranks put back together are the whole model. Ranks are
simulated in this process (only construction and loading run; no collective is needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.tiny_models import make_tiny_checkpoint
from worker_service.attention import get_attention_backend
from worker_service.loader.model_loading import load_checkpoint
from worker_service.parallel import distributed

NUM_RANKS = 2
SHAPES = {
    "sharded-kv": dict(num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=509),
    "replicated-kv": dict(num_heads=4, num_kv_heads=1, head_dim=16, hidden_size=64, vocab_size=512),
}


def load_as_rank(path: Path, rank: int, world_size: int, monkeypatch) -> dict[str, torch.Tensor]:
    with monkeypatch.context() as patch:
        patch.setattr(distributed, "_state", distributed.ParallelState(rank, world_size, None))  # type: ignore[arg-type]
        model, _ = load_checkpoint(str(path), torch.float32, torch.device("cpu"), get_attention_backend("torch"))
    return dict(model.named_parameters())


def write_gguf(folder: Path, projection_type: int | None = None, vocab_size: int = 0) -> Path:
    """The qwen3 checkpoint in folder as a GGUF file, projections quantized to projection_type (a
    GGMLQuantizationType; Q8_0 when None); with vocab_size, a placeholder tokenizer of that many tokens
    (so that the offline LLM loads the file)."""
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType.Q8_0 if projection_type is None else projection_type
    from worker_service.loader.gguf_loader import _BLOCK_NAMES, _GLOBAL_NAMES

    config = __import__("json").loads((folder / "config.json").read_text())
    to_gguf = {hf: name for name, hf in _GLOBAL_NAMES.items()}
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), "qwen3")
    for key, value in [("block_count", config["num_hidden_layers"]), ("context_length", 256),
                       ("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("attention.key_length", config["head_dim"])]:
        writer.add_uint32(f"qwen3.{key}", value)
    writer.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("qwen3.rope.freq_base", 10000.0)
    if vocab_size:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "ab", *(f"t{i}" for i in range(3, vocab_size))])
        writer.add_token_merges(["a b"])
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        name = to_gguf.get(hf_name)
        if name is None:
            layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            name = f"blk.{layer}.{next(g for g, h in _BLOCK_NAMES.items() if h == module)}.{suffix}"
        array = tensor.numpy()
        if "proj" in hf_name:
            writer.add_tensor(name, gguf.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (folder / "model.safetensors").unlink()  # so that the folder holds only the GGUF file
    return folder / "model.gguf"


def expected_slice(name: str, full: torch.Tensor, rank: int, spec: dict) -> torch.Tensor:
    """Rank's part of a whole-model parameter, computed from the model's shape alone."""
    heads, kv_heads, head_dim = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    if "embed_tokens" in name or "lm_head" in name:
        rows = -(-full.shape[0] // NUM_RANKS)
        part = full[rank * rows:(rank + 1) * rows]
        return torch.cat([part, full.new_zeros(rows - part.shape[0], *full.shape[1:])])
    if "qkv_proj" in name:
        q, k, v = full.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        local_kv = max(kv_heads // NUM_RANKS, 1)
        first_kv = rank * kv_heads // NUM_RANKS
        kv_rows = slice(first_kv * head_dim, (first_kv + local_kv) * head_dim)
        return torch.cat([q.chunk(NUM_RANKS)[rank], k[kv_rows], v[kv_rows]])
    if "gate_up_proj" in name:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(NUM_RANKS)[rank], up.chunk(NUM_RANKS)[rank]])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return full.chunk(NUM_RANKS, dim=1)[rank]
    return full


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ranks_hold_their_slices(kind: str, shape: str, tmp_path: Path, monkeypatch) -> None:
    spec = SHAPES[shape]
    path = make_tiny_checkpoint(tmp_path, "qwen3", **spec)
    if kind == "gguf":
        path = write_gguf(path)
    whole = load_as_rank(path, 0, 1, monkeypatch)
    for rank in range(NUM_RANKS):
        part = load_as_rank(path, rank, NUM_RANKS, monkeypatch)
        assert part.keys() == whole.keys()
        for name, full in whole.items():
            np.testing.assert_array_equal(part[name].numpy(), expected_slice(name, full, rank, spec).numpy(),
                                          err_msg=f"rank {rank}: {name}")
