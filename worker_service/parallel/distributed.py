"""Tensor-parallel process group of one worker: who this rank is, and the few collectives the
layers and the model runner need. With one rank (the default) every collective is a no-op, so
single-device code pays nothing.

Two groups: the device group (NCCL on GPUs, gloo on CPUs) for activations, logits and sampled
tokens, and a gloo group on the host for control messages (StepChannel), so that passing a Step
to the other ranks never touches the GPU stream (no host sync).

On GPUs the layers' sums can skip NCCL: a layer writes its partial result straight into a buffer
in torch's symmetric memory (`partial_sum_buffer`: every rank can read every rank's) and
`all_reduce` sums it there, two-shot (each rank sums half the elements, then reads the other half).
Measured on two H200s inside CUDA graphs (bench/allreduce_bench.py): 6 to 13 us for the 8 KiB to
2 MiB of a decode step where NCCL takes 11 to 32 us. No copy into the buffer: with one, the
saving halved (57361a8). NCCL stays the path for CPUs and for a second group built in a process
(see init_symmetric_sum).
"""
from __future__ import annotations

import datetime
import logging
import math
import os
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


logger = logging.getLogger(__name__)
# Set to 0, every sum goes through NCCL: an escape hatch, and the A/B of bench/tp_gpu.sh.
SYMMETRIC_SUMS_ENV = "NANOVLLM_TP_SYMMETRIC_SUMS"
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
        _SymmetricSum.instance = None
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
    """The sum of x over the ranks (captured by CUDA graphs): x itself, summed in place by NCCL, or,
    when x is a partial_sum_buffer, a new tensor (the buffer is reused by the next sum)."""
    if tp_size() == 1:
        return x
    symmetric = _SymmetricSum.instance
    if symmetric is not None and symmetric.holds(x):
        return symmetric.sum(x)
    dist.all_reduce(x)
    return x


def partial_sum_buffer(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
    """Where to write a partial result of `shape` (dtype and device of `like`) that all_reduce will
    sum: the front of the symmetric buffer, or None (write it anywhere) without one or when it does
    not fit. Valid until the next all_reduce."""
    symmetric = _SymmetricSum.instance
    return symmetric.front(shape, like) if symmetric is not None else None


def sums_in_symmetric_memory() -> bool:
    """Whether this rank's all_reduce sums partial_sum_buffers in symmetric memory (else NCCL or gloo)."""
    return _SymmetricSum.instance is not None


class _SymmetricSum:
    """One buffer in symmetric memory, sized for the largest sum of a step."""

    instance: _SymmetricSum | None = None
    built_in_this_process = False

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        _SymmetricSum.built_in_this_process = True

    def front(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        numel = math.prod(shape)
        if like.dtype != self.buffer.dtype or like.device != self.buffer.device or numel > self.buffer.numel():
            return None
        return self.buffer[:numel].view(shape)

    def holds(self, x: torch.Tensor) -> bool:
        return x.data_ptr() == self.buffer.data_ptr() and x.dtype == self.buffer.dtype and x.is_contiguous()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(x, "sum", self.group_name, out)
        return out


def init_symmetric_sum(max_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Gives all_reduce a symmetric-memory buffer for sums of up to max_rows x hidden_size, when every
    rank can have one: GPU ranks that reach each other's memory, in a process that built none
    before (torch keeps a group's symmetric-memory state by group name, and a second group of the
    same name in one process, as tests and benchmarks build, waited forever on the first one's),
    unless NANOVLLM_TP_SYMMETRIC_SUMS=0.
    A collective: every rank calls it at the same point, once the group exists."""
    if tp_size() == 1:
        return
    usable = os.environ.get(SYMMETRIC_SUMS_ENV, "1") != "0" and device.type == "cuda" \
        and not _SymmetricSum.built_in_this_process and all(
        torch.cuda.can_device_access_peer(device, peer) for peer in range(tp_size()) if peer != device.index)
    if min_over_ranks(int(usable), device):
        _SymmetricSum.instance = _SymmetricSum(max_rows * hidden_size, dtype, device)
    logger.info("tensor-parallel sums: %s", "symmetric memory, two-shot" if _SymmetricSum.instance else "NCCL")


def all_gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's slice of the vocabulary's logits [n, rows per rank] -> the whole rows
    [n, vocab_size] (ranks in order, the last rank's padding dropped), on every rank."""
    if tp_size() == 1:
        return logits
    whole = all_gather_rows(logits).movedim(0, 1).reshape(logits.shape[0], -1)
    return whole[:, :vocab_size].contiguous()


def all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] on every rank -> [world_size, n, ...], rank order, on every rank."""
    size = tp_size()
    if size == 1:
        return x.unsqueeze(0)
    # Ranks concatenated along dimension 0 (the layout gloo requires; NCCL takes it too).
    gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x.contiguous())
    return gathered.view(size, *x.shape)


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
