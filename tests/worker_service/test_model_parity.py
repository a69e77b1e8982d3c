"""Our models over a paged KV cache against Hugging Face transformers, in float32 on the CPU.

Each step goes through the real paged path: K/V written at slot_mapping into blocks handed out in
a shuffled order, attention reading them back through the block table. The caches start as NaN, so
reading any slot that was not written shows up in the logits.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import make_tiny_checkpoint
from worker_service.attention import default_backend_name, get_attention_backend
from worker_service.attention.base import AttentionMetadata
from worker_service.loader import load_model
from worker_service.models import LlamaForCausalLM

BLOCK_SIZE = 16


class PagedCache:
    """A test stand-in for the block manager and model runner: per-sequence block tables over a
    KV cache whose blocks are handed out in random order."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 32, seed: int = 0) -> None:
        config = model.config
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        for attention in model.attention_layers():
            attention.k_cache = torch.full(shape, float("nan"))
            attention.v_cache = torch.full(shape, float("nan"))
        self.model = model
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed_tokens: dict[int, int] = {}

    def step(self, seq_to_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Computes the given new tokens of each sequence in one batch; returns each sequence's logits
        for its new tokens [num_new_tokens, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for seq_id, tokens in seq_to_tokens.items():
            start = self.num_computed_tokens.get(seq_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            self.num_computed_tokens[seq_id] = end
        tables = [self.block_tables[seq_id] for seq_id in seq_to_tokens]
        width = max(len(t) for t in tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), metadata)
            logits = self.model.compute_logits(hidden)
        return dict(zip(seq_to_tokens, logits.split(query_lens), strict=True))


@dataclass
class Pair:
    ours: LlamaForCausalLM
    hf: Any
    folder: Path


def load_pair(folder: Path) -> Pair:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ours, _ = load_model(folder, torch.float32, "cpu", "torch")
    return Pair(ours, hf, folder)


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()))


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-hd64-gqa1": dict(arch="qwen3", num_heads=2, num_kv_heads=2, head_dim=64, hidden_size=64),
    "qwen3-hd32-gqa2": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128),
    "qwen3-hd32-gqa4-tied": dict(arch="qwen3", num_heads=8, num_kv_heads=2, head_dim=32, hidden_size=128, tie=True),
    "qwen3-sharded": dict(arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64,
                          max_shard_size="40KB"),
    "llama-tied": dict(arch="llama", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, tie=True),
    "llama-untied-gqa4": dict(arch="llama", num_heads=4, num_kv_heads=1, head_dim=16, hidden_size=64),
    "llama-rope-llama3": dict(arch="llama", num_heads=2, num_kv_heads=1, head_dim=32, hidden_size=64,
                              rope_scaling=LLAMA3_ROPE),
    "llama-rope-linear": dict(arch="llama", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(arch="qwen2", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, tie=True),
    # sparse layers 0 and 2 (top-2 of 8 experts), dense layer 1
    "qwen3_moe-mixed": dict(arch="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                            num_layers=3, mlp_only_layers=(1,)),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    kwargs = dict(CONFIGS[request.param])
    arch = kwargs.pop("arch")
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **kwargs)
    return load_pair(folder)


def test_full_prompt_matches_hf(pair: Pair) -> None:
    tokens = random_tokens(37, pair.ours.config.vocab_size, seed=1)
    logits = PagedCache(pair.ours).step({0: tokens})[0]
    assert_logits_close(logits, hf_logits(pair.hf, tokens))


def test_chunked_prefill_then_decode_matches_hf(pair: Pair) -> None:
    tokens = random_tokens(36, pair.ours.config.vocab_size, seed=2)
    ref = hf_logits(pair.hf, tokens)
    cache = PagedCache(pair.ours, seed=3)
    # Chunk boundaries inside blocks, then decode steps that cross into a third block.
    bounds = [(0, 13), (13, 30), *((i, i + 1) for i in range(30, 36))]
    for start, end in bounds:
        logits = cache.step({7: tokens[start:end]})[7]
        assert_logits_close(logits, ref[start:end])


def test_mixed_batch_of_three_matches_hf(pair: Pair) -> None:
    vocab_size = pair.ours.config.vocab_size
    seqs = {seq_id: random_tokens(n, vocab_size, seed=10 + seq_id) for seq_id, n in ((0, 6), (1, 30), (2, 41))}
    refs = {seq_id: hf_logits(pair.hf, tokens) for seq_id, tokens in seqs.items()}
    cache = PagedCache(pair.ours, seed=4)
    # Step 1: three prefills (the middle one partial). Step 2: decode, prefill chunk, decode.
    first = {0: 5, 1: 22, 2: 40}
    out = cache.step({seq_id: seqs[seq_id][:n] for seq_id, n in first.items()})
    for seq_id, n in first.items():
        assert_logits_close(out[seq_id], refs[seq_id][:n])
    second = {0: (5, 6), 1: (22, 30), 2: (40, 41)}
    out = cache.step({seq_id: seqs[seq_id][a:b] for seq_id, (a, b) in second.items()})
    for seq_id, (a, b) in second.items():
        assert_logits_close(out[seq_id], refs[seq_id][a:b])


def test_dynamic_ntk_decode_past_original_length_matches_hf(tmp_path: Path) -> None:
    """Dynamic NTK rescales the base past max_position_embeddings; HF does it per forward call, so
    compare against HF's own token-by-token decode with its KV cache (the case we reproduce exactly)."""
    folder = make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64,
                                  max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    pair = load_pair(folder)
    assert pair.ours.model.layers[0].self_attn.rotary_emb.max_positions == 64
    tokens = random_tokens(45, pair.ours.config.vocab_size, seed=5)
    cache = PagedCache(pair.ours, seed=6)
    with torch.inference_mode():
        out = pair.hf(torch.tensor([tokens[:20]]), use_cache=True)
        assert_logits_close(cache.step({0: tokens[:20]})[0], out.logits[0])
        for i in range(20, len(tokens)):
            out = pair.hf(torch.tensor([tokens[i:i + 1]]), cache=out.past_key_values, use_cache=True)
            assert_logits_close(cache.step({0: tokens[i:i + 1]})[0], out.logits[0])


def test_bfloat16_model_keeps_float32_rotary_and_tracks_float32(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "qwen3", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64)
    ours32, _ = load_model(folder, torch.float32, "cpu")
    ours16, config = load_model(folder, torch.bfloat16, "cpu")
    assert torch.get_default_dtype() == torch.float32
    assert ours16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours16.model.layers[0].self_attn.rotary_emb.cos.dtype == torch.float32
    tokens = random_tokens(20, config.vocab_size, seed=7)
    logits32 = PagedCache(ours32).step({0: tokens})[0]
    logits16 = PagedCache(ours16).step({0: tokens})[0]
    assert logits16.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits; the argmax of most positions must agree.
    agree = (logits16.float().argmax(-1) == logits32.argmax(-1)).float().mean().item()
    assert agree >= 0.8


def test_missing_and_unknown_tensors_are_reported(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path, "llama", num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)
    tensors = load_file(folder / "model.safetensors")
    up = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight\[1\]"):
        load_model(folder, torch.float32, "cpu")
    tensors["model.layers.1.mlp.up_proj.weight"] = up
    tensors["model.layers.1.mlp.extra.weight"] = up.clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(KeyError, match="extra"):
        load_model(folder, torch.float32, "cpu")


def test_backend_registry() -> None:
    assert default_backend_name(torch.device("cpu")) == "torch"
    assert get_attention_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("no-such-backend")
