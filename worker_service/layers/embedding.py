"""Token embedding and the output head (possibly tied to it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.layers.linear import attach_loader, default_weight_loader


class VocabEmbedding(nn.Module):
    """Token id -> hidden vector. Tensor parallelism would split the vocabulary rows."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        attach_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> logits over the vocabulary. `tie_to(embedding)` shares the embedding's weight, so
    loaders see one parameter (named after the embedding) and skip lm_head.weight."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        attach_loader(self.weight, default_weight_loader)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
