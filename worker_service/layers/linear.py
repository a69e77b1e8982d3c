"""Linear layers with fused weights (q/k/v, gate/up) and per-shard weight loaders.

Every parameter carries a `weight_loader(param, tensor, shard_id)` attribute and a `shard_ids`
tuple naming the shards that must all be loaded ((None,) for an unfused weight). Checkpoint
loaders only go through these, so tensor parallelism can later change what a rank keeps (a slice
of each shard) without touching the loaders. Single device for now: each rank would hold all.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ShardId = int | str | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def attach_loader(param: nn.Parameter, loader: WeightLoader, shard_ids: Sequence[ShardId] = (None,)) -> None:
    """Marks param with the loader checkpoint loaders call and the shards it needs."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = tuple(shard_ids)  # type: ignore[attr-defined]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """Copies loaded into target (casting dtype, moving device) after checking the shape."""
    if target.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Loader of an unfused parameter: the whole tensor at once."""
    if shard_id is not None:
        raise ValueError(f"unfused parameter got shard {shard_id!r}")
    copy_checked(param.data, loaded, "weight")


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_size, input_size], loaded whole."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        for param in self._params():
            attach_loader(param, default_weight_loader)

    def _params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class RowLinear(LinearBase):
    """A linear whose input dimension tensor parallelism will split (o_proj, down_proj), followed
    then by an all-reduce. Single device: a plain linear."""


class MergedColumnLinear(LinearBase):
    """Several linears of the same input fused along the output dimension (gate_proj + up_proj):
    shard i occupies rows sum(output_sizes[:i]) .. + output_sizes[i] of the weight and bias."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_names: Sequence[ShardId] | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_names: tuple[ShardId, ...] = tuple(shard_names or range(len(output_sizes)))
        if len(self.shard_names) != len(self.output_sizes):
            raise ValueError("one shard name per output size")
        for param in self._params():
            attach_loader(param, self.weight_loader, self.shard_names)

    def shard_rows(self, shard_id: ShardId) -> tuple[int, int]:
        """(row offset, row count) of a shard in the fused weight."""
        if shard_id not in self.shard_names:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has shards {self.shard_names}")
        index = self.shard_names.index(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        offset, rows = self.shard_rows(shard_id)
        copy_checked(param.data.narrow(0, offset, rows), loaded, f"shard {shard_id!r}")


class QKVLinear(MergedColumnLinear):
    """q, k and v projections fused into one weight [(num_heads + 2 * num_kv_heads) * head_dim, hidden];
    shards "q", "k", "v" in that order. The output splits with `split_sizes`."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, shard_names=("q", "k", "v"))

    @property
    def split_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]


def loader_of(param: nn.Parameter) -> tuple[WeightLoader, tuple[Any, ...]]:
    """The (weight_loader, shard_ids) of a parameter; unmarked parameters are loaded whole."""
    return getattr(param, "weight_loader", default_weight_loader), getattr(param, "shard_ids", (None,))
