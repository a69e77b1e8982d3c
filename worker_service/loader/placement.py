"""Where and in what form a worker holds its model: a rank's device, the dtype, the weight format
and the attention backend, as a WorkerConfig asks for them ("auto": what suits the device)."""
from __future__ import annotations

from pathlib import Path

import torch

from common.contract.config import WorkerConfig
from common.formats.checkpoint import find_gguf_file
from worker_service.attention import AttentionBackend, default_backend_name, get_attention_backend


def resolve_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of a rank: with tensor parallelism rank r takes the r-th visible GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and world_size > 1:
        return torch.device("cuda", rank)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """name: one of WorkerConfig.dtype's choices."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def resolve_cpu_weight_format(name: str, device_type: str, is_gguf: bool, tensor_parallel_size: int = 1) -> str:
    """auto: int4 for GGUF checkpoints on the CPU in one process, float32 elsewhere. int4 asked for
    on a GPU, for a checkpoint that is not GGUF, or with tensor parallelism (the int4 layers are built
    from whole GGUF tensors, not from a rank's shard) is an error rather than a silent no-op."""
    can_use_int4 = device_type == "cpu" and is_gguf and tensor_parallel_size == 1
    if name == "auto":
        return "int4" if can_use_int4 else "float32"
    if name == "int4" and not can_use_int4:
        raise ValueError("cpu_weight_format: int4 needs a GGUF checkpoint on the CPU and tensor_parallel_size 1")
    return name


def resolve_weights_and_backend(config: WorkerConfig, device: torch.device) -> tuple[str, AttentionBackend]:
    """The weight format ("float32" or "int4") of config's model on device, and the attention backend
    (under config.deterministic a batch-invariant one: auto picks it, and naming another is an error)."""
    weight_format = resolve_cpu_weight_format(config.cpu_weight_format, device.type,
                                              find_gguf_file(Path(config.model)) is not None,
                                              config.tensor_parallel_size)
    if config.deterministic and device.type == "cpu" and resolve_dtype(config.dtype, device) != torch.float32:
        raise ValueError(f"dtype: --deterministic on the CPU needs float32 activations, not {config.dtype}")
    backend_name = config.attention_backend
    if backend_name == "auto":
        backend_name = default_backend_name(device, is_quantized=weight_format != "float32",
                                            deterministic=config.deterministic)
    backend = get_attention_backend(backend_name)
    if config.deterministic and not backend.batch_invariant:
        raise ValueError(f"attention_backend: {backend_name} is not batch-invariant, which --deterministic needs; "
                         f"use {default_backend_name(device, deterministic=True)} (or auto)")
    return weight_format, backend
