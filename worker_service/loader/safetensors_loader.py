"""Loads HF safetensors checkpoints (single file or sharded) into our models."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from worker_service.attention import AttentionBackend, default_backend_name, get_attention_backend
from worker_service.loader.random_weights import is_random_checkpoint, iter_random_tensors
from worker_service.loader.weight_mapping import LoadedKey, check_all_loaded, load_named_tensor
from worker_service.models import LlamaForCausalLM, build_model
from worker_service.models.config import ModelConfig


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint. With an index json, only the files it names (a folder
    may also hold e.g. a consolidated copy of the same weights); otherwise every *.safetensors."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        weight_map: dict[str, str] = json.loads(indexes[0].read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor on the CPU) for every tensor of the checkpoint, one file open at a time."""
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as file:
            for name in file.keys():
                yield name, file.get_tensor(name)


def load_named_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Fills every parameter of model from (HF name, tensor) pairs; raises if any tensor is unknown,
    loaded twice, or if any parameter is left unloaded."""
    loaded: set[LoadedKey] = set()
    for hf_name, tensor in tensors:
        for key in load_named_tensor(model, hf_name, tensor):
            if key in loaded:
                raise ValueError(f"checkpoint tensor {hf_name!r} appears more than once in {source}")
            loaded.add(key)
    check_all_loaded(model, loaded)


def load_hf_weights(model: nn.Module, folder: str | Path) -> None:
    """Fills every parameter of model from the safetensors checkpoint in folder (or, for a random
    checkpoint, from tensors drawn on the model's device: random_weights)."""
    if is_random_checkpoint(folder):
        tensors = iter_random_tensors(folder, next(model.parameters()).device)
    else:
        tensors = iter_safetensors(folder)
    load_named_tensors(model, tensors, str(folder))


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str,
               backend: AttentionBackend | str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Builds the model of an HF folder directly on device in dtype and loads its weights.

    backend: an instance, a registry name, or None for the device's default backend.
    """
    model = build_empty_model(ModelConfig.from_hf_folder(folder), dtype, device, backend)
    load_hf_weights(model, folder)
    return model.eval(), model.config


def build_empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                      backend: AttentionBackend | str | None = None) -> LlamaForCausalLM:
    """The model of config, built directly on device in dtype, weights not loaded yet."""
    device = torch.device(device)
    if backend is None:
        backend = default_backend_name(device)
    if isinstance(backend, str):
        backend = get_attention_backend(backend)
    previous_dtype = torch.get_default_dtype()
    # Parameters are created in place (no float32 copy on the host, no later .to(dtype) that would
    # also round the rotary tables, which stay float32 by construction).
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config, backend)
    finally:
        torch.set_default_dtype(previous_dtype)
    return model
