"""Linear layers with fused weights (q/k/v, gate/up) and per-shard weight loaders.

Every parameter carries a `weight_loader(param, tensor, shard_id)` attribute and a `shard_ids`
tuple naming the shards that must all be loaded ((None,) for an unfused weight). Checkpoint
loaders hand over whole tensors and only go through these; with tensor parallelism the layers
keep their rank's slice (gpt-fast's tp.py style: the model code reads the same at any rank count).

Column-parallel layers (QKV, gate/up) keep a slice of each shard's output rows and need no
communication; row-parallel layers (o_proj, down_proj) keep a slice of the input columns and sum
their partial outputs over the ranks.

The products go through `KERNELS["linear"]`: reference_linear (F.linear), or on GPUs (fused_kernels.enable)
a version that sends decode-sized inputs (few rows) to a Triton kernel that reads the weight at bandwidth.
A row-parallel product is written where distributed.all_reduce sums it fastest (partial_sum_buffer).
Row-parallel layers go through `KERNELS["row_linear"]` and the output head through `KERNELS["lm_head"]`,
so that a deterministic worker (worker_service.invariant.enable) can replace all of them with
batch-invariant products.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.layers import activation
from worker_service.parallel.distributed import all_reduce, partial_sum_buffer, tp_rank, tp_size

if TYPE_CHECKING:
    from worker_service.layers.norm import RMSNorm

ShardId = int | str | tuple[int, str] | None  # tuples: (expert, projection) of MoE experts
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    return KERNELS["linear"](x, weight, bias, out)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, written into `out` when one is given (a contiguous [..., N] tensor; no bias then),
    by the same matmul F.linear calls."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is not None:
        raise ValueError("reference_linear: a bias with out")
    return torch.matmul(x, weight.t(), out=out)


def normed_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                  layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(s)), s) with s = x + residual, or x when residual is None (the first layer): a
    pre-norm block's norm and the projection after it, and the residual stream the next norm adds back.
    On GPUs decode-sized inputs of a column-parallel layer take one kernel (KERNELS["normed_linear"])."""
    return KERNELS["normed_linear"](x, residual, norm, layer)


def compose_normed_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                          layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    normed, total = (norm(x), x) if residual is None else norm(x, residual)
    return layer(normed), total


def silu_and_mul_linear(gate_up: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """layer(silu_and_mul(gate_up)): a gated MLP's activation and its down product. On GPUs decode-sized
    inputs of an unsharded layer take one kernel (KERNELS["silu_and_mul_linear"])."""
    return KERNELS["silu_and_mul_linear"](gate_up, layer)


def compose_silu_and_mul_linear(gate_up: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return layer(activation.KERNELS["silu_and_mul"](gate_up))


def reference_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel product (RowLinear): this rank's partial x W^T, summed over the ranks, then the bias."""
    if tp_size() == 1:
        return _linear(x, weight, bias)
    partial = _linear(x, weight, None, partial_sum_buffer((*x.shape[:-1], weight.shape[0]), x))
    out = all_reduce(partial)
    return out + bias if bias is not None else out


# The implementations the layers call; fused_kernels.enable() swaps in triton_skinny_matmul's on GPUs,
# worker_service.invariant.enable() batch-invariant ones (--deterministic).
KERNELS: dict[str, Callable[..., Any]] = {"linear": reference_linear, "normed_linear": compose_normed_linear,
                                          "silu_and_mul_linear": compose_silu_and_mul_linear,
                                          "row_linear": reference_row_linear, "lm_head": reference_linear}


def attach_loader(param: nn.Parameter, loader: WeightLoader, shard_ids: Sequence[ShardId] = (None,)) -> None:
    """Marks param with the loader checkpoint loaders call and the shards it needs."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = tuple(shard_ids)  # type: ignore[attr-defined]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """Copies loaded into target (casting dtype, moving device) after checking the shape."""
    if target.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def split_evenly(size: int, what: str) -> int:
    """This rank's share of size, which must divide by the number of ranks."""
    if size % tp_size():
        raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size {tp_size()}")
    return size // tp_size()


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
        return _linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class RowLinear(LinearBase):
    """A linear whose input dimension is split over the ranks (o_proj, down_proj): each rank holds
    columns [rank * input_size / N, ...) of W, multiplies its slice of the input (the output of a
    column-parallel layer) and the partial outputs are summed over ranks. The bias is added once,
    after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(split_evenly(input_size, "row-parallel input size"), output_size, bias)
        self.full_input_size = input_size
        attach_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"unfused parameter got shard {shard_id!r}")
        check_shape(loaded, (self.output_size, self.full_input_size), "weight")
        copy_checked(param.data, loaded.narrow(1, tp_rank() * self.input_size, self.input_size), "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KERNELS["row_linear"](x, self.weight, self.bias)


class MergedColumnLinear(LinearBase):
    """Several linears of the same input fused along the output dimension (gate_proj + up_proj),
    each split over the ranks by output rows: shard i (full size full_output_sizes[i]) keeps
    output_sizes[i] = full / N rows on each rank, at rows sum(output_sizes[:i]) of the fused weight."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_names: Sequence[ShardId] | None = None) -> None:
        self.full_output_sizes = list(output_sizes)
        local_sizes = self._local_sizes(self.full_output_sizes)
        super().__init__(input_size, sum(local_sizes), bias)
        self.output_sizes = local_sizes
        self.shard_names: tuple[ShardId, ...] = tuple(shard_names or range(len(output_sizes)))
        if len(self.shard_names) != len(self.output_sizes):
            raise ValueError("one shard name per output size")
        for param in self._params():
            attach_loader(param, self.weight_loader, self.shard_names)

    def _local_sizes(self, full_sizes: list[int]) -> list[int]:
        return [split_evenly(size, "column-parallel output size") for size in full_sizes]

    def _source_row(self, index: int) -> int:
        """The first row of a full checkpoint shard that this rank keeps."""
        return tp_rank() * self.output_sizes[index]

    def shard_rows(self, shard_id: ShardId) -> tuple[int, int]:
        """(row offset, row count) of a shard in this rank's fused weight."""
        if shard_id not in self.shard_names:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has shards {self.shard_names}")
        index = self.shard_names.index(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        offset, rows = self.shard_rows(shard_id)
        index = self.shard_names.index(shard_id)
        what = f"shard {shard_id!r}"
        check_shape(loaded, (self.full_output_sizes[index], *param.shape[1:]), what)
        copy_checked(param.data.narrow(0, offset, rows), loaded.narrow(0, self._source_row(index), rows), what)


class QKVLinear(MergedColumnLinear):
    """q, k and v projections fused into one weight [(num_heads + 2 * num_kv_heads) * head_dim, hidden];
    shards "q", "k", "v" in that order. The output splits with `split_sizes`.

    Over N ranks each keeps num_heads / N query heads and the KV heads they read: num_kv_heads / N
    of them, or, with fewer KV heads than ranks, one KV head replicated on N / num_kv_heads ranks.
    `num_heads` and `num_kv_heads` are this rank's counts."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, "num_heads")
        size = tp_size()
        if num_kv_heads % size and size % num_kv_heads:
            raise ValueError(f"num_kv_heads {num_kv_heads} and tensor_parallel_size {size}: one must divide the other")
        self.num_kv_heads = max(num_kv_heads // size, 1)
        # Query head h reads KV head h // (num_heads / num_kv_heads): the first one of this rank's heads.
        self.kv_head_start = tp_rank() * self.num_heads // (num_heads // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, shard_names=("q", "k", "v"))

    def _local_sizes(self, full_sizes: list[int]) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def _source_row(self, index: int) -> int:
        return tp_rank() * self.q_size if index == 0 else self.kv_head_start * self.head_dim

    @property
    def split_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def loader_of(param: nn.Parameter) -> tuple[WeightLoader, tuple[Any, ...]]:
    """The (weight_loader, shard_ids) of a parameter; unmarked parameters are loaded whole."""
    return getattr(param, "weight_loader", default_weight_loader), getattr(param, "shard_ids", (None,))
