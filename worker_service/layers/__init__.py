"""Model building blocks (norms, rotary embedding, fused linears, embeddings); single-device for now,
with fused weight layouts and shard loaders that tensor parallelism can later split."""

from worker_service.layers.activation import SiluAndMul
from worker_service.layers.embedding import LMHead, VocabEmbedding
from worker_service.layers.linear import LinearBase, MergedColumnLinear, QKVLinear, RowLinear
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
    "SiluAndMul",
    "VocabEmbedding",
]
