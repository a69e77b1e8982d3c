"""The Llama-family decoder (llama, qwen2, and with per-head q/k norms, qwen3; with sparse MoE
blocks in place of some MLPs, qwen3_moe).

Parameter names follow HF checkpoints, except that q/k/v and gate/up are fused
(`self_attn.qkv_proj`, `mlp.gate_up_proj`) and the experts stacked (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); the loaders map the HF names onto their shards.
"""
from __future__ import annotations

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend, AttentionMetadata
from worker_service.layers import (
    LMHead,
    MergedColumnLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    SparseMoeBlock,
    VocabEmbedding,
    normed_linear,
    silu_and_mul_linear,
)
from worker_service.models.config import ModelConfig


class Attention(nn.Module):
    """Self-attention over the paged KV cache. The model runner assigns `k_cache` and `v_cache`
    ([num_blocks, block_size, num_kv_heads, head_dim]) before the first forward pass."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.qkv_proj = QKVLinear(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                  bias=config.attention_bias)
        # The heads this module computes: all of them, or its rank's share under tensor parallelism.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        # HF's qwen2 has biases on q/k/v only; llama and qwen3 put attention_bias on o_proj too.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = RowLinear(config.num_heads * config.head_dim, config.hidden_size, bias=o_bias)
        # Qwen3 normalises each head of q and k before rotary.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.has_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.has_qk_norm else None
        self.rotary_emb = rotary  # shared by all layers
        self.backend = backend
        # Plain attributes, not buffers: the cache is not part of the checkpoint or of state_dict.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # With an fp8 cache, each cached head vector's scale ([num_blocks, block_size, num_kv_heads]).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(hidden + residual) through attention; returns it and the sum (the residual stream)."""
        qkv, residual = normed_linear(hidden, residual, norm, self.qkv_proj)
        q, k, v = qkv.split(self.qkv_proj.split_sizes, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q = self.backend.rope_and_store(q, k, v, positions, self.rotary_emb, self.q_norm, self.k_norm,
                                        self.k_cache, self.v_cache, metadata, self.k_scale, self.v_scale)
        out = self.backend.attend(q, self.k_cache, self.v_cache, metadata, self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim)), residual


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size])
        self.down_proj = RowLinear(size, config.hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) through the MLP; returns it and the sum (the residual stream)."""
        gate_up, residual = normed_linear(x, residual, norm, self.gate_up_proj)
        return silu_and_mul_linear(gate_up, self.down_proj), residual


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream is passed alongside the hidden state so that each
    residual add is fused into the following RMSNorm, and each norm into the projection after it
    where a kernel does both (linear.normed_linear)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A MoE model's sparse layers route each token to a few experts; its other layers, and every
        # layer of a dense model, have one MLP.
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_index) else MLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, metadata)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> final hidden states."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, backend, index)
                                    for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The causal LM used by the model runner.

    forward(input_ids [num_tokens], positions [num_tokens], metadata) -> hidden [num_tokens, hidden_size];
    compute_logits(hidden [n, hidden_size]) -> logits [n, vocab_size] in the model dtype, on whichever
    rows the caller selected (usually the last token of each sequence); with gather=False and
    several ranks, this rank's columns of them (lm_head.own_rows tokens from lm_head.vocab_start).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)  # registered before lm_head: a tied weight keeps the embedding's name
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        return self.lm_head(hidden, gather)

    def attention_layers(self) -> list[Attention]:
        """The attention modules in layer order, for the runner to assign KV caches to."""
        return [layer.self_attn for layer in self.model.layers]
