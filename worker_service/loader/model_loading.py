"""Loads a checkpoint into our model: a Hugging Face folder (config.json + safetensors) or a GGUF file."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from common.formats.checkpoint import find_gguf_file
from common.formats.gguf_file import GGUFFile
from worker_service.attention.base import AttentionBackend
from worker_service.loader.cpu_quantization import quantize_gguf_model_for_cpu
from worker_service.loader.gguf_loader import gguf_model_config, iter_gguf_hf_tensors
from worker_service.loader.safetensors_loader import build_empty_model, load_model, load_named_tensors
from worker_service.models.config import ModelConfig


def load_checkpoint(model: str, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                    weight_format: str = "float32") -> tuple[nn.Module, ModelConfig]:
    """weight_format: "float32" (weights in `dtype`) or "int4" (GGUF on the CPU: see cpu_quantization)."""
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model: {model} does not exist")
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return load_gguf_model(gguf_file, dtype, device, backend, weight_format)
    if weight_format != "float32":
        raise ValueError(f"weight format {weight_format!r} needs a GGUF checkpoint")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model: {model} holds neither config.json nor a .gguf file")
    return load_model(path, dtype, device, backend)


def read_model_config(model: str) -> ModelConfig:
    """The model configuration of a checkpoint, without loading its weights."""
    path = Path(model)
    gguf_file = find_gguf_file(path) if path.exists() else None
    if gguf_file is not None:
        return gguf_model_config(GGUFFile(gguf_file))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model: {model} holds neither config.json nor a .gguf file")
    return ModelConfig.from_hf_folder(path)


def load_gguf_model(path: Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
                    weight_format: str = "float32") -> tuple[nn.Module, ModelConfig]:
    """Builds the model from GGUF metadata and loads its dequantized tensors, one at a time; with
    weight_format "int4", the 4-bit projections then also keep their GGUF codes for the CPU kernels."""
    gguf = GGUFFile(path)
    config = gguf_model_config(gguf)
    model = build_empty_model(config, dtype, device, backend)
    tensors = ((name, torch.from_numpy(array)) for name, array in iter_gguf_hf_tensors(gguf))
    load_named_tensors(model, tensors, str(path))
    if weight_format == "int4":
        quantize_gguf_model_for_cpu(model, gguf, config)
    return model.eval(), config
