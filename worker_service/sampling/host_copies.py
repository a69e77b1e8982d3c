"""Step inputs from the host to the device without blocking the host: pinned memory on CUDA."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host-to-device copy of a list that never blocks the host."""
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Like to_device, for a host tensor: the worker's one way of moving step inputs."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
