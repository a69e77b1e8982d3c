"""Batch-invariant kernels (--deterministic, issue 30): with them a sequence's greedy and seeded outputs
are the same bits whatever else its steps hold, however its prompt is chunked, whether its prefix came
from the prefix cache, after a preemption's recompute, and at any tensor-parallel size.

`enable(device)` is the one door: called where a worker process (or a tensor-parallel rank) starts, it
swaps the process-wide kernel tables for dispatchers that send CPU tensors to this package's CPU
kernels and CUDA tensors to `triton_products` (imported at the first CUDA call). What it swaps, and why:

- the products (linear.KERNELS linear, normed_linear, silu_and_mul_linear, row_linear, lm_head): BLAS
  libraries choose how to split and order a row's sum by the shape of the call (cpu_products,
  triton_products); on the CPU MKL is also held to its AVX-512 or AVX2 code path, which it otherwise
  chooses by the CPU's vendor (cpu_products.pin_mkl_code_path);
- a mixture of experts' experts on GPUs (layers.moe.KERNELS): the fused kernels with one block
  configuration for every batch (triton_moe.INVARIANT_CONFIG); on the CPU the reference loop is invariant
  through the products it calls;
- SiLU on the CPU: torch's vectorised silu rounds the tail of each stretch differently (cpu_activation);
- the int4 CPU path (quantized_cpu.KERNELS): every step through the int4 and int8 kernels (their
  results were row-invariant at every row count measured), never the float32 layers that serve large
  steps by default, and the head's exact candidate logits summed one product after another.

The attention backend is chosen by placement (the invariant one of the device under `auto`). The
rest of the forward pass and the sampler are row-invariant as they are: elementwise (rotary
embedding, residual adds, embeddings) or measured so (tests/worker_service/test_invariant_cpu.py
holds them to it): RMSNorm (F.rms_norm, for rows of up to 32,768 values; torch splits longer ones
over threads), softmax, log_softmax, sort, topk and cumsum over the vocabulary. On the CPU the
activations must be float32 (placement checks).

`prepare(model)` lays out a loaded model's CPU float32 weights for the products (cpu_layout), where the
worker loads its model. `disable()` puts back what enable() replaced: for tests and benchmarks that
compare both in one process.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from worker_service.invariant import cpu_activation, cpu_products
from worker_service.invariant.cpu_layout import prepare
from worker_service.layers import activation, linear, moe
from worker_service.loader import quantized_cpu

__all__ = ["disable", "enable", "is_enabled", "prepare"]
logger = logging.getLogger(__name__)
_TRITON_PRODUCTS = "worker_service.invariant.triton_products"
# (table, key) -> what enable() replaced there; empty while disabled.
_replaced: dict[tuple[int, str], tuple[dict[str, Callable[..., Any]], Callable[..., Any]]] = {}


def enable(device: torch.device) -> None:
    """Installs the batch-invariant kernels for this process (idempotent), whose models run on device
    (the CPU or CUDA)."""
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"deterministic: no batch-invariant kernels for {device}")
    if _replaced:
        return
    if torch.device(device).type == "cpu":
        cpu_products.pin_mkl_code_path()  # before the model's first product (a worker calls this at its start)
    _swap(linear.KERNELS, "linear", _by_device(cpu_products.linear, "linear"))
    _swap(linear.KERNELS, "normed_linear", _by_device(linear.compose_normed_linear, "normed_linear"))
    _swap(linear.KERNELS, "silu_and_mul_linear", linear.compose_silu_and_mul_linear)  # through row_linear's
    _swap(linear.KERNELS, "row_linear", _by_device(cpu_products.row_linear, "row_linear"))
    _swap(linear.KERNELS, "lm_head", _by_device(cpu_products.linear, "linear"))
    gpu_silu = activation.KERNELS["silu_and_mul"]  # elementwise on GPUs: already invariant
    _swap(activation.KERNELS, "silu_and_mul",
          lambda x: gpu_silu(x) if x.is_cuda else cpu_activation.silu_and_mul(x))
    _swap(moe.KERNELS, "experts", _experts)
    _swap(quantized_cpu.KERNELS, "dense_serves", _never)
    _swap(quantized_cpu.KERNELS, "candidate_logits", cpu_products.candidate_logits)
    logger.info("deterministic: batch-invariant kernels enabled")


def disable() -> None:
    """Puts back the kernels enable() replaced (idempotent)."""
    for (_, key), (table, previous) in _replaced.items():
        table[key] = previous
    _replaced.clear()


def is_enabled() -> bool:
    return bool(_replaced)


def _swap(table: dict[str, Callable[..., Any]], key: str, kernel: Callable[..., Any]) -> None:
    _replaced[(id(table), key)] = (table, table[key])
    table[key] = kernel


def _never(num_tokens: int, max_quantized_tokens: int) -> bool:
    """quantized_cpu.dense_serves under --deterministic: every step takes the quantized kernels."""
    return False


def _by_device(cpu: Callable[..., Any], cuda_name: str) -> Callable[..., Any]:
    """A kernel that runs cpu on CPU tensors and triton_products' function cuda_name on CUDA tensors."""

    def kernel(x: torch.Tensor, *args: Any) -> Any:
        if x.is_cuda:
            return getattr(_triton_products(), cuda_name)(x, *args)
        return cpu(x, *args)

    return kernel


def _experts(x: torch.Tensor, *args: Any) -> torch.Tensor:
    """moe.KERNELS["experts"] under --deterministic: one block configuration on GPUs, the reference loop
    (over the invariant products) on the CPU."""
    if not x.is_cuda:
        return moe.reference_experts(x, *args)
    from worker_service.layers.triton_moe import invariant_experts  # GPUs only

    return invariant_experts(x, *args)


def _triton_products() -> ModuleType:
    try:
        return importlib.import_module(_TRITON_PRODUCTS)
    except ModuleNotFoundError as error:
        if error.name != _TRITON_PRODUCTS:
            raise
        raise NotImplementedError("deterministic: no batch-invariant CUDA products (worker_service/invariant/"
                                  "triton_products.py)") from error
