"""Tensor-parallel process group of one worker: who this rank is, and the few collectives the
layers and the model runner need. With one rank (the default) every collective is a no-op, so
single-device code pays nothing.

Two groups: the device group (NCCL on GPUs, gloo on CPUs) for activations, logits and sampled
tokens, and a gloo group on the host for control messages (StepChannel), so that passing a Step
to the other ranks never touches the GPU stream (no host sync).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Control messages wait as long as the worker stays idle; the default 30 minutes would end an
# idle group. A dead peer still fails the wait at once (its socket closes).
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    control_group: dist.ProcessGroup


_state: ParallelState | None = None
# torch 2.13 renames all_gather_into_tensor (same arguments); the GPU machine runs 2.11.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def init_tensor_parallel(rank: int, world_size: int, init_address: str, device: torch.device) -> None:
    """Joins the group of world_size ranks that meet at init_address (tcp://host:port)."""
    global _state
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_address, rank=rank, world_size=world_size, **kwargs)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _state = ParallelState(rank, world_size, control)


def destroy_tensor_parallel() -> None:
    global _state
    if _state is not None:
        _state = None
        dist.destroy_process_group()


def tp_rank() -> int:
    return _state.rank if _state is not None else 0


def tp_size() -> int:
    return _state.world_size if _state is not None else 1


def control_group() -> dist.ProcessGroup:
    if _state is None:
        raise RuntimeError("no tensor-parallel group")
    return _state.control_group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (captured by CUDA graphs on NCCL)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., d] on every rank -> [..., world_size * d], rank order, on every rank."""
    size = tp_size()
    if size == 1:
        return x
    # Ranks concatenated along dimension 0 (the layout gloo requires; NCCL takes it too).
    gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x.contiguous())
    return gathered.view(size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Overwrites x with rank 0's x, in place: sampled tokens stay identical on every rank."""
    if tp_size() > 1:
        dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest value over ranks (the KV budget of the group is its smallest rank's)."""
    if tp_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
