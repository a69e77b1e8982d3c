"""Fused elementwise kernels on GPUs, instead of the five to ten small kernels each takes eagerly (in a
decode step those small kernels, not bandwidth, would dominate): RMSNorm (with its residual add) and
SiLU-and-mul as hand-written Triton kernels, a mixture of experts' experts as grouped products
(triton_moe), rotary embedding (for the torch attention backend) compiled by torch.compile. Hand-written
where the host time of a call counts: Inductor's dynamic-shape SiLU took 5.1 us per decode call on an
H200, and a compiled norm costs ~190 us of host time per call outside CUDA graphs (dynamo's guards and
wrappers), a third of a prefill's. The eager versions stay the reference; CPUs take the fewer-op eager
ones of cpu_kernels (`enable_for` chooses by device). Linear layers of at most 16 rows in 16-bit dtypes
go to a Triton matrix-vector kernel (triton_skinny_matmul), others stay on cuBLAS; there the norm before
a column-parallel projection runs in that kernel too. The Triton kernels (attention, sampling) size
their grids by num_sms."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from worker_service.layers import activation, cpu_kernels, linear, moe, norm, rotary

logger = logging.getLogger(__name__)
_enabled = False


def enable_for(device: torch.device, enforce_eager: bool) -> None:
    """The elementwise kernels of a worker process on device (process-wide, so called where a worker
    or a tensor-parallel rank starts): Triton and compiled ones on a GPU with CUDA graphs, fewer-op
    eager ones on a CPU, the reference ones otherwise."""
    if device.type == "cuda" and not enforce_eager:
        enable()
    elif device.type == "cpu":
        cpu_kernels.enable()


def enable() -> None:
    """Swaps in the GPU kernels (idempotent). Compilation happens at the first call of each,
    with dynamic batch sizes, so warm-up runs must precede CUDA graph capture."""
    global _enabled
    if _enabled:
        return
    # One compiled graph per call site shape family (hidden [n, d] and per-head [n, h, d] norms,
    # each model's constants): raise dynamo's default limit of 8 so that none falls back to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compile_ = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)  # noqa: E731
    from worker_service.layers import triton_activation, triton_moe, triton_norm, triton_skinny_matmul  # GPUs only

    rotary.KERNELS["rotary"] = _on_gpus(compile_(rotary.apply_rotary), rotary.apply_rotary)
    norm.KERNELS["rms_norm"] = _on_gpus(_by_dtype(triton_norm.rms_norm, compile_(norm.rms_norm)), norm.rms_norm)
    norm.KERNELS["add_rms_norm"] = _on_gpus(_by_dtype(triton_norm.add_rms_norm, compile_(norm.add_rms_norm)),
                                            norm.add_rms_norm)
    activation.KERNELS["silu_and_mul"] = _on_gpus(triton_activation.silu_and_mul, activation.silu_and_mul)
    moe.KERNELS["experts"] = _on_gpus(triton_moe.fused_experts, moe.reference_experts)
    # These send CPU tensors to the reference themselves (use_skinny).
    linear.KERNELS["linear"] = triton_skinny_matmul.linear
    linear.KERNELS["normed_linear"] = triton_skinny_matmul.normed_linear
    linear.KERNELS["silu_and_mul_linear"] = triton_skinny_matmul.silu_and_mul_linear
    _enabled = True
    logger.info("fused elementwise kernels enabled (Triton, torch.compile)")


def _on_gpus(gpu: Callable, reference: Callable) -> Callable:
    """gpu for CUDA tensors, the eager reference for others: the tables are process-wide, and a CPU
    model may run in a process whose GPU worker enabled them (a notebook, a test session)."""

    def kernel(x: torch.Tensor, *args: object) -> object:
        return gpu(x, *args) if x.is_cuda else reference(x, *args)

    return kernel


def _by_dtype(half: Callable, full: Callable) -> Callable:
    """half for 16-bit activations, full for float32: there the GPU tests hold the whole model
    token-exact with transformers, and the Triton norm, which sums a row in another order than
    Inductor's kernel, moved a last bit that flipped a near-tie token of one tiny model (H200)."""

    def kernel(x: torch.Tensor, *args: object) -> object:
        return full(x, *args) if x.dtype == torch.float32 else half(x, *args)

    return kernel


def num_sms(device: torch.device, otherwise: int) -> int:
    """Multiprocessors of a CUDA device (cached: asking once is a driver call, not a sync); otherwise
    on other devices (the CPU, Triton's interpreter)."""
    if device.type != "cuda":
        return otherwise
    return _device_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
