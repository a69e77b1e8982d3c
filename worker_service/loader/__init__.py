"""Checkpoint loading: HF-style tensor names mapped onto the model's (fused) parameters."""

from worker_service.loader.safetensors_loader import load_hf_weights, load_model
from worker_service.loader.weight_mapping import (
    LoadedKey,
    check_all_loaded,
    hf_name_to_param,
    load_named_tensor,
)

__all__ = ["LoadedKey", "check_all_loaded", "hf_name_to_param", "load_hf_weights", "load_model", "load_named_tensor"]
