"""The sparse mixture-of-experts block of Qwen3-MoE: a router picks each token's top-k experts (each a
gated MLP, down(silu(gate(x)) * up(x))) and the block returns their outputs weighted by the routing
probabilities.

Routing is transformers' Qwen3MoeSparseMoeBlock's: router logits in the activation dtype, a softmax over
all experts in float32, the top-k probabilities, divided by their sum when norm_topk_prob (still
float32). transformers then rounds the weights to the activation dtype before multiplying; here the
expert kernel receives them in float32, and reference_experts rounds them at that point (a no-op in
float32).

The experts run through `KERNELS["experts"]` (the contract is reference_experts' docstring), so that a
GPU kernel can replace the reference's loop over experts.

Tensor parallelism splits the experts, not their matrices: rank r of N holds experts
[r * E / N, (r + 1) * E / N) whole. The router is replicated, so every rank routes every token alike,
computes the contribution of its own experts, and the partial sums are added over the ranks, as a
row-parallel layer's are.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from worker_service.layers import activation, linear
from worker_service.layers.linear import LinearBase, ShardId, attach_loader, check_shape, copy_checked
from worker_service.parallel.distributed import all_reduce, partial_sum_buffer, tp_rank, tp_size

if TYPE_CHECKING:
    from worker_service.layers.norm import RMSNorm


class MoeShape(Protocol):
    """What the block reads of the model configuration (ModelConfig has it; layers do not import models)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def norm_topk_prob(self) -> bool: ...


def reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, first_expert: int) -> torch.Tensor:
    """This rank's share of the experts' weighted sum, for every token.

    x [T, H]; w13 [E_local, 2 I, H] (expert e's gate_proj rows, then its up_proj rows); w2 [E_local, H, I]
    (down_proj); topk_ids [T, k] int64, global expert ids; topk_weights [T, k] float32; the experts held
    are [first_expert, first_expert + E_local), and ids outside contribute nothing. Returns [T, H] in
    x.dtype: sum over the token's chosen local experts e of weight * down_e(silu(gate_e(x)) * up_e(x)).

    A loop over the experts that got tokens, in transformers' eager order (ascending experts, each
    expert's tokens by top-k slot then token, the routing weight rounded to x.dtype, accumulated into
    zeros with index_add_), so that float32 results match its bits as far as the matmuls do.
    """
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    local_ids = (topk_ids - first_expert).t()  # [k, T]: transformers walks its expert mask in this order
    is_local = (local_ids >= 0) & (local_ids < w13.shape[0])
    for expert in torch.unique(local_ids[is_local]).tolist():
        slots, tokens = torch.where(local_ids == expert)
        gate_up = linear.KERNELS["linear"](x[tokens], w13[expert], None)
        down = linear.KERNELS["linear"](activation.KERNELS["silu_and_mul"](gate_up), w2[expert], None)
        out.index_add_(0, tokens, down * weights[tokens, slots, None])
    return out


# The implementation the block calls; a GPU kernel with reference_experts' signature may replace it.
KERNELS: dict[str, Callable[..., Any]] = {"experts": reference_experts}


class Experts(nn.Module):
    """The expert MLPs of one sparse layer, stacked for this rank's experts [first_expert, first_expert +
    num_local_experts): gate_up_proj [E_local, 2 I, H] and down_proj [E_local, H, I].

    Checkpoints hold one matrix per expert and projection; the shard ids are (expert, "gate") and
    (expert, "up") of gate_up_proj, (expert, "down") of down_proj, for every expert of the model. A rank
    checks the shape of another rank's expert and drops it: it still counts as loaded, so the loader's
    completeness check covers every expert of the checkpoint on every rank."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        size = tp_size()
        if num_experts % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide num_experts {num_experts} "
                             "(each rank holds an equal share of whole experts)")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // size
        self.first_expert = tp_rank() * self.num_local_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size),
                                      requires_grad=False)
        experts = range(num_experts)
        attach_loader(self.gate_up_proj, self.weight_loader, [(e, part) for e in experts for part in ("gate", "up")])
        attach_loader(self.down_proj, self.weight_loader, [(e, "down") for e in experts])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        parts = ("down",) if param is self.down_proj else ("gate", "up")
        if not (isinstance(shard_id, tuple) and 0 <= shard_id[0] < self.num_experts and shard_id[1] in parts):
            raise ValueError(f"unknown shard {shard_id!r}; this parameter takes (expert < {self.num_experts}, "
                             f"one of {parts})")
        expert, part = shard_id
        what = f"expert {expert} {part}_proj"
        size, hidden = self.intermediate_size, self.hidden_size
        check_shape(loaded, (hidden, size) if part == "down" else (size, hidden), what)
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        target = param.data[local]
        if part != "down":
            target = target.narrow(0, 0 if part == "gate" else size, size)
        copy_checked(target, loaded, what)

    def extra_repr(self) -> str:
        return (f"experts={self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}")


class SparseMoeBlock(nn.Module):
    """The MoE block in place of a decoder layer's MLP, with MLP's forward contract: the router `gate`
    (weight [num_experts, hidden], no bias, replicated on every rank) and the `experts`."""

    def __init__(self, config: MoeShape) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = LinearBase(config.hidden_size, config.num_experts)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] float32, topk_ids [T, k] int64) of each token, as transformers routes."""
        logits = self.gate(hidden)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual) through the experts; returns it and the sum (the residual stream)."""
        hidden, residual = (norm(x), x) if residual is None else norm(x, residual)
        weights, ids = self.route(hidden)
        experts = self.experts
        out = KERNELS["experts"](hidden, experts.gate_up_proj, experts.down_proj, ids, weights, experts.first_expert)
        return (_sum_over_ranks(out) if tp_size() > 1 else out), residual


def _sum_over_ranks(partial: torch.Tensor) -> torch.Tensor:
    """The ranks' partial sums added up, through the buffer where all_reduce sums fastest when there is one."""
    buffer = partial_sum_buffer(tuple(partial.shape), partial)
    if buffer is not None:
        buffer.copy_(partial)
        partial = buffer
    return all_reduce(partial)
