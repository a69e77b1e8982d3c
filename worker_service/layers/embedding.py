"""Token embedding and the output head (possibly tied to it), split over the ranks by vocabulary
rows: each rank holds ceil(vocab_size / N) rows (the last rank's tail is zero padding)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.layers.linear import KERNELS, ShardId, attach_loader, check_shape
from worker_service.parallel.distributed import all_gather_vocab, all_reduce, partial_sum_buffer, tp_rank, tp_size


class VocabParallelWeight(nn.Module):
    """Holds this rank's rows [vocab_start, vocab_start + rows_per_rank) of a [vocab, hidden] weight."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows_per_rank = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        attach_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"unfused parameter got shard {shard_id!r}")
        check_shape(loaded, (self.vocab_size, self.hidden_size), "weight")
        param.data[:self.own_rows].copy_(loaded[self.vocab_start:self.vocab_start + self.own_rows])
        param.data[self.own_rows:].zero_()

    @property
    def own_rows(self) -> int:
        """How many of this rank's rows are tokens (the last rank's tail is zero padding)."""
        return max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))


class VocabEmbedding(VocabParallelWeight):
    """Token id -> hidden vector. Over several ranks, each looks up the ids in its rows (zeros for
    the others) and the vectors are summed over the ranks: exact, since one rank adds a value and
    the others add zeros."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        is_here = (local >= 0) & (local < self.rows_per_rank)
        hidden = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        partial = partial_sum_buffer(hidden.shape, hidden)
        return all_reduce(torch.mul(hidden, is_here.unsqueeze(-1).to(hidden.dtype), out=partial))


class LMHead(VocabParallelWeight):
    """hidden -> logits over the vocabulary. `tie_to(embedding)` shares the embedding's weight, so
    loaders see one parameter (named after the embedding) and skip lm_head.weight. Over several
    ranks each computes the logits of its rows and, unless asked not to, every rank gathers the
    full row (sampling can do without: worker_service/sampling/vocab_parallel.py)."""

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        logits = KERNELS["lm_head"](hidden, self.weight)
        if tp_size() == 1 or not gather:
            return logits
        return all_gather_vocab(logits, self.vocab_size)
