"""The memory floor of a workload's decode phase: the bytes each decode iteration must read, over the
device's bandwidth, summed over the iterations.

Each iteration reads every dense weight once (attention, norms, routers, the output head; the
embedding only by rows, so not counted unless tied to the head), the experts the batch touches, and
each running sequence's K/V. With every request admitted at once (the reference workload: 256
requests, max_num_seqs 256), iteration i runs the sequences that want more than i tokens. The
experts touched by n tokens are taken at their expectation under uniform routing (what random
weights give): E (1 - (1 - k / E)^n) per sparse layer.
"""
from __future__ import annotations

from bisect import bisect_right

from worker_service.models.config import ModelConfig


def attention_params(config: ModelConfig) -> int:
    """One layer's q, k, v and o projections."""
    return config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)


def dense_mlp_params(config: ModelConfig) -> int:
    """One dense layer's gate, up and down projections."""
    return 3 * config.hidden_size * config.intermediate_size


def weight_bytes(config: ModelConfig, dtype_bytes: int = 2) -> tuple[float, float]:
    """(bytes of the weights every iteration reads, bytes of one expert's three matrices)."""
    hidden = config.hidden_size
    attention, dense_mlp = attention_params(config), dense_mlp_params(config)
    router = config.num_experts * hidden
    per_layer = [attention + 2 * hidden + (router if config.is_moe_layer(layer) else dense_mlp)
                 for layer in range(config.num_layers)]
    head = config.vocab_size * hidden
    expert = 3 * hidden * config.moe_intermediate_size
    return (sum(per_layer) + head + hidden) * dtype_bytes, expert * dtype_bytes


def expected_experts_touched(config: ModelConfig, num_tokens: int) -> float:
    experts, top_k = config.num_experts, config.num_experts_per_tok
    return experts * (1 - (1 - top_k / experts) ** num_tokens) if experts else 0.0


def kv_bytes_per_token(config: ModelConfig, fp8: bool) -> float:
    """K and V of one token over all layers: bf16 values, or e4m3 values with a float32 scale each."""
    per_head = config.head_dim + 4 if fp8 else 2 * config.head_dim
    return 2 * config.num_layers * config.num_kv_heads * per_head


def decode_floor_seconds(config: ModelConfig, prompt_lens: list[int], max_tokens: list[int], bandwidth: float,
                         fp8_cache: bool = False) -> float:
    dense, expert = weight_bytes(config)
    sparse_layers = sum(config.is_moe_layer(layer) for layer in range(config.num_layers))
    running = sorted(max_tokens)
    total = 0.0
    for iteration in range(max(max_tokens)):
        batch = len(running) - bisect_right(running, iteration)  # sequences wanting more than `iteration`
        total += dense + sparse_layers * expected_experts_touched(config, batch) * expert
    kv_tokens = sum(p * m + m * (m + 1) / 2 for p, m in zip(prompt_lens, max_tokens, strict=True))
    return (total + kv_tokens * kv_bytes_per_token(config, fp8_cache)) / bandwidth

