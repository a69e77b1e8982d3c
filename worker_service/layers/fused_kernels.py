"""Fused elementwise kernels on GPUs: RMSNorm (with its residual add) and rotary embedding
compiled by torch.compile (Inductor emits one Triton kernel for each), SiLU-and-mul as a hand-written
Triton kernel (a plain 2-D grid; Inductor's dynamic-shape one took 5.1 us per decode call on an
H200), instead of the five to ten small kernels each takes eagerly. In a decode step those small
kernels, not bandwidth, would dominate. Linear layers of at most 16 rows go to a Triton matrix-vector
kernel (triton_skinny_matmul), others stay on cuBLAS. The eager versions stay the reference; CPUs take
the fewer-op eager ones of cpu_kernels (`enable_for` chooses by device)."""
from __future__ import annotations

import logging

import torch

from worker_service.layers import activation, cpu_kernels, linear, norm, rotary

logger = logging.getLogger(__name__)
_enabled = False


def enable_for(device: torch.device, enforce_eager: bool) -> None:
    """The elementwise kernels of a worker process on device (process-wide, so called where a worker
    or a tensor-parallel rank starts): compiled ones on a GPU with CUDA graphs, fewer-op eager ones
    on a CPU, the reference ones otherwise."""
    if device.type == "cuda" and not enforce_eager:
        enable()
    elif device.type == "cpu":
        cpu_kernels.enable()


def enable() -> None:
    """Swaps in compiled versions (idempotent). Compilation happens at the first call of each,
    with dynamic batch sizes, so warm-up runs must precede CUDA graph capture."""
    global _enabled
    if _enabled:
        return
    # One compiled graph per call site shape family (hidden [n, d] and per-head [n, h, d] norms,
    # each model's constants): raise dynamo's default limit of 8 so that none falls back to eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compile_ = lambda fn: torch.compile(fn, dynamic=True, fullgraph=True)  # noqa: E731
    norm.KERNELS["rms_norm"] = compile_(norm.rms_norm)
    norm.KERNELS["add_rms_norm"] = compile_(norm.add_rms_norm)
    rotary.KERNELS["rotary"] = compile_(rotary.apply_rotary)
    from worker_service.layers import triton_activation, triton_skinny_matmul  # Triton: imported on GPUs only

    activation.KERNELS["silu_and_mul"] = triton_activation.silu_and_mul
    linear.KERNELS["linear"] = triton_skinny_matmul.linear
    _enabled = True
    logger.info("fused elementwise kernels enabled (torch.compile)")
