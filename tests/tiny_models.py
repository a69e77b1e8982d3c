"""Tiny random Hugging Face checkpoints (float32, safetensors) for CPU parity tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_ARCH_TO_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def make_tiny_checkpoint(
    tmp_path: Path,
    arch: str,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
    intermediate_size: int | None = None,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 256,
    max_shard_size: int | str | None = None,
    seed: int = 0,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    save_original_format: bool = True,
) -> Path:
    """Saves a randomly initialised HF model of arch ("qwen3", "llama", "qwen2", "qwen3_moe") to
    tmp_path/arch and returns the folder. rope_scaling is HF's dict without rope_theta, e.g.
    {"rope_type": "linear", "factor": 2.0}; max_shard_size splits the safetensors into shards with an
    index json.

    Weights are redrawn at a larger scale than HF's init (std 0.02), and norm weights and biases
    are made non-trivial, so that attention is sharp and a wrongly loaded tensor changes the logits.

    qwen3_moe only: the expert and routing fields (HF's names); save_original_format=False writes
    transformers' fused expert stacks instead of the per-expert tensors of Hub checkpoints. The
    router is drawn wider than the other weights so that routing is decided (no near-ties between a
    token's k-th and k+1-th expert) and each layer uses several experts, some of them rarely.
    """
    import transformers

    config_name, model_name = _ARCH_TO_CLASSES[arch]
    moe: dict[str, Any] = {}
    if arch == "qwen3_moe":
        moe = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                   moe_intermediate_size=moe_intermediate_size, norm_topk_prob=norm_topk_prob,
                   decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers))
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        rms_norm_eps=1e-6,
        eos_token_id=vocab_size - 1,
        bos_token_id=0,
        **moe,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    _randomise(model, seed)
    folder = Path(tmp_path) / arch
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if not save_original_format:
        kwargs["save_original_format"] = False
    model.save_pretrained(folder, **kwargs)
    return folder


_ROUTER_SCALE = 3.0


def _randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif param.ndim == 1:  # biases
                param.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            elif name.endswith("mlp.gate.weight"):  # a MoE router: see make_tiny_checkpoint
                param.copy_(_ROUTER_SCALE * noise / param.shape[-1] ** 0.5)
            else:  # matrices [out, in] and stacks of experts [experts, out, in]
                param.copy_(noise / param.shape[-1] ** 0.5)


CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is.",
    "Un café crème, s'il vous plaît. Ça coûte combien? Über den Wolken, naïve façade.",
    "日本語のテキストと中文文本。 Emoji: 🤖🚀✨ and symbols → ∑ ∞ ≈.",
    "def main():\n    return 42\n\nNumbers 0123456789, dates 2026-11-29.",
]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_slow_cpu_checkpoint(folder: Path, max_position_embeddings: int) -> Path:
    """A qwen3 of 8 layers of width 512 with a tokenizer: slow enough on a CPU that streams are mid-way
    when a test's fault comes (a worker killed, a liveness probe missed)."""
    path = make_tiny_checkpoint(folder, "qwen3", num_heads=8, num_kv_heads=4, head_dim=64, hidden_size=512,
                                intermediate_size=2048, num_layers=8, max_position_embeddings=max_position_embeddings)
    save_tiny_bpe_tokenizer(path)
    return path


def save_tiny_bpe_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer trained on a small multilingual corpus, saved as tokenizer.json
    and tokenizer_config.json (with a chat template). Multi-byte characters outside the merges are
    split over several byte tokens, which is what incremental detokenization must handle."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|end|>", "chat_template": TINY_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_greedy_generate(path: Path, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt by the checkpoint at path (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf_greedy_continuations(model, prompts, num_new_tokens)


def hf_greedy_continuations(model: Any, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """A loaded transformers model's greedy continuation of each prompt, one at a time, EOS ignored."""
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            results.append(out[0, len(prompt):].tolist())
    return results
