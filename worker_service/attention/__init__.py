"""Attention backends, chosen by name from a small registry.

Backends register themselves with `@register_backend(name)` when their module is imported. The
modules are imported lazily, on the first request for one of their names, so asking for the CPU
backend never imports Triton or CUDA code.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from worker_service.attention.base import AttentionBackend, AttentionMetadata

# name -> module that registers it on import. GPU backends add their line here.
_BACKEND_MODULES: dict[str, str] = {
    "torch": "worker_service.attention.torch_backend",
    "torch-sdpa": "worker_service.attention.torch_backend",
    "triton": "worker_service.attention.triton_backend",
    "triton-invariant": "worker_service.attention.triton_invariant",
    "torch-invariant": "worker_service.attention.torch_invariant",
    "flash-attn": "worker_service.attention.flash_attn_backend",
}
# device type -> default backend name; devices not listed fall back to the portable "torch" backend
# (on Hopper GPUs with flash-attn-4 installed, flash-attn: flash_attn_runs_on).
_DEVICE_DEFAULTS: dict[str, str] = {
    "cpu": "torch",
    "cuda": "triton",
}
# device type -> default backend name under --deterministic (a batch-invariant one).
_INVARIANT_DEFAULTS: dict[str, str] = {
    "cpu": "torch-invariant",
    "cuda": "triton-invariant",
}
_REGISTRY: dict[str, type[AttentionBackend]] = {}

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "available_backends",
    "default_backend_name",
    "flash_attn_runs_on",
    "get_attention_backend",
    "register_backend",
]


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: registers an AttentionBackend subclass under name (and sets its `name`)."""

    def decorate(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention backend {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def get_attention_backend(name: str) -> AttentionBackend:
    """A new instance of the backend registered under name, importing its module if needed."""
    if name not in _REGISTRY and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {available_backends()}")
    return _REGISTRY[name]()


def available_backends() -> list[str]:
    """Names that get_attention_backend accepts (importable or already registered)."""
    return sorted(set(_BACKEND_MODULES) | set(_REGISTRY))


def default_backend_name(device: torch.device, is_quantized: bool = False, deterministic: bool = False) -> str:
    """The backend to use on device when the config names none: with quantized (approximate) weights
    on a CPU, the torch backend's faster prefill attention, which is not bit-identical to transformers';
    deterministic: the device's batch-invariant backend."""
    device_type = torch.device(device).type
    if deterministic:
        if device_type not in _INVARIANT_DEFAULTS:
            raise ValueError(f"deterministic: no batch-invariant attention backend for {device_type}")
        return _INVARIANT_DEFAULTS[device_type]
    if device_type == "cuda" and flash_attn_runs_on(torch.device(device)):
        return "flash-attn"
    name = _DEVICE_DEFAULTS.get(device_type, "torch")
    return "torch-sdpa" if name == "torch" and is_quantized else name


def flash_attn_runs_on(device: torch.device) -> bool:
    """Whether the flash-attn backend is the better default on device: a Hopper GPU (where it was
    measured: prefill attention 1.08-1.47x the Triton kernel's rate, bench/results/2026-12-02-h200-flash-attn-pdl.md)
    with the flash-attn-4 package installed."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    try:
        importlib.import_module("flash_attn.cute")
    except ImportError:
        return False
    return True
