"""Model building blocks (norms, rotary embedding, fused linears, embeddings, the MoE block). The linears and the
embedding/head apply tensor parallelism themselves (worker_service.parallel.distributed says the rank), so
the models read the same at any rank count."""

from worker_service.layers.embedding import LMHead, VocabEmbedding
from worker_service.layers.linear import (
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    normed_linear,
    silu_and_mul_linear,
)
from worker_service.layers.moe import SparseMoeBlock
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import RotaryEmbedding

__all__ = [
    "LMHead",
    "LinearBase",
    "MergedColumnLinear",
    "QKVLinear",
    "RMSNorm",
    "RowLinear",
    "RotaryEmbedding",
    "SparseMoeBlock",
    "VocabEmbedding",
    "normed_linear",
    "silu_and_mul_linear",
]
