"""Weight-only quantized linears for the CPU, on torch's own kernels.

Decode on a CPU reads every weight once per token, so its speed is the weight bytes over memory
bandwidth: 4.5-bit weights read 7x less than float32. torch's `_weight_int4pack_mm_for_cpu` (group-wise
int4) and `_weight_int8pack_mm` (per-row int8) are vectorised only for bfloat16 activations, so the
input is rounded to bfloat16 and the product returned in the model's dtype. Large steps (prefill) are
compute-bound, where the float32 GEMM of the layer being wrapped is faster: those keep using it.

A deterministic worker (worker_service.invariant.enable) swaps the two choices of KERNELS: every step
takes the quantized kernels (the float32 layer is another computation, so a row's result would change
with the size of its step), and the head's exact logits are summed in a fixed order.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker_service.loader.gguf_int4 import GROUP_SIZE, Int4Groups

# Steps of at most this many tokens use the quantized kernel; larger ones the wrapped float32 layer.
MAX_QUANTIZED_TOKENS = 16


def dense_serves(num_tokens: int, max_quantized_tokens: int) -> bool:
    """Whether a step of num_tokens rows takes the wrapped float32 layer instead of the quantized kernel."""
    return num_tokens > max_quantized_tokens


def candidate_logits(weight: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The float32 logits of each token's candidates: [tokens, num_candidates]."""
    rows = weight[candidates]  # [tokens, num_candidates, hidden]
    return torch.matmul(rows, hidden[:, :, None]).squeeze(-1)


# The choices the layers make; worker_service.invariant.enable() swaps in batch-invariant ones.
KERNELS: dict[str, Callable[..., Any]] = {"dense_serves": dense_serves, "candidate_logits": candidate_logits}


class Int4Linear(nn.Module):
    """y = x W^T + b with W held as group-wise int4 (the codes and constants of a GGUF Q4_0/Q4_1 weight).

    `dense` is the float32 layer it replaces: it serves steps of more than max_quantized_tokens rows and
    keeps the attributes callers read (split_sizes of the fused q/k/v projection).
    """

    def __init__(self, dense: nn.Module, groups: Int4Groups, max_quantized_tokens: int = MAX_QUANTIZED_TOKENS) -> None:
        super().__init__()
        rows, cols = groups.codes.shape
        if cols % GROUP_SIZE:
            raise ValueError(f"int4 weight needs a multiple of {GROUP_SIZE} inputs, got {cols}")
        self.dense = dense
        self.split_sizes = getattr(dense, "split_sizes", None)
        self.max_quantized_tokens = max_quantized_tokens
        codes = torch.from_numpy(groups.codes).to(torch.int32)
        # innerKTiles is ignored by the CPU packing (it exists for the CUDA layout)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)
        scales_and_zeros = torch.stack([torch.from_numpy(groups.scales).T, torch.from_numpy(groups.zeros).T], dim=-1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16).contiguous(), persistent=False)
        self.output_size = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        if KERNELS["dense_serves"](num_tokens, self.max_quantized_tokens):
            return self.dense(x)
        # x = high + low, both bfloat16: 16 mantissa bits of the input instead of 8, in one call (the
        # weights are read once for both halves, and reading them is the cost at these sizes). Written
        # into one buffer, and the halves summed in x's dtype, in as few ops as that takes: at decode
        # sizes each op's dispatch costs about as much as its work.
        both = x.new_empty((2 * num_tokens, x.shape[1]), dtype=torch.bfloat16)
        high = both[:num_tokens]
        high.copy_(x)
        torch.sub(x, high, out=both[num_tokens:])  # in x's dtype (type promotion), then rounded
        halves = torch.ops.aten._weight_int4pack_mm_for_cpu(both, self.packed, GROUP_SIZE, self.scales_and_zeros)
        out = halves[:num_tokens].to(x.dtype).add_(halves[num_tokens:])
        bias = getattr(self.dense, "bias", None)
        return out if bias is None else out.add_(bias)


class Int8Head(nn.Module):
    """The output head with its weight also held as per-row int8, for decode-sized steps.

    torch's `_weight_int8pack_mm` reads 4x fewer bytes than the float32 head, but takes bfloat16 input and
    rounds the logits to bfloat16: alone, its top-1 agreed with the float32 head at only 97 % of
    positions of real text (ties and near-ties reorder). So its logits only pick candidates: the
    `num_exact` best of each row are recomputed in float32 from the float32 rows and written back.
    The float32 top-1 was among the approximate top 4 at every one of 2,000 positions of real text, so
    greedy decode takes the float32 head's token unless it falls outside the top `num_exact`; sampling
    sees exact logits for the likely tokens and, for the rest, logits off by 0.06 on average (0.8 at
    most over those positions).
    """

    def __init__(self, dense: nn.Module, max_quantized_tokens: int = MAX_QUANTIZED_TOKENS,
                 num_exact: int = 32) -> None:
        super().__init__()
        self.dense = dense  # keeps serving larger steps, and holds the float32 rows for the exact pass
        self.max_quantized_tokens = max_quantized_tokens
        self.num_exact = num_exact
        weight = dense.weight.detach()
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("codes", torch.round(weight / scales[:, None]).to(torch.int8), persistent=False)
        self.register_buffer("scales", scales.to(torch.bfloat16), persistent=False)

    def forward(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """gather: as LMHead's (one rank only here: nothing to gather)."""
        if KERNELS["dense_serves"](hidden.shape[0], self.max_quantized_tokens):
            return self.dense(hidden)
        logits = torch.ops.aten._weight_int8pack_mm(hidden.to(torch.bfloat16), self.codes, self.scales).to(hidden.dtype)
        candidates = logits.topk(min(self.num_exact, logits.shape[-1]), dim=-1, sorted=False).indices
        exact = KERNELS["candidate_logits"](self.dense.weight, candidates, hidden)
        return logits.scatter_(-1, candidates, exact)
