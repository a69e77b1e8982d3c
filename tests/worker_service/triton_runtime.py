"""Where the Triton kernel tests run: on a CUDA device, or else on the CPU through Triton's
interpreter, at small sizes, whenever the interpreter works here (Triton installed, as the dev extra
brings it, and numpy below 2.3: Triton 3.6's interpreter calls int() on one-element arrays, an
error since numpy 2.3).

Importing this module sets TRITON_INTERPRET=1 in that case. It must happen before any kernel module
is imported (`triton.jit` reads it when a kernel is defined): conftest.py imports it first.
"""
from __future__ import annotations

import importlib.util
import os

import numpy
import pytest
import torch

_NUMPY_VERSION = tuple(int(part) for part in numpy.__version__.split(".")[:2])
INTERPRETER_WORKS = importlib.util.find_spec("triton") is not None and _NUMPY_VERSION < (2, 3)
if not torch.cuda.is_available() and INTERPRETER_WORKS:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# The flash-attn backend's package (flash-attn-4; its kernels need a Hopper or newer GPU).
FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None


def skip_module_unless_kernels_run() -> None:
    """Skips the calling test module (at import, before it imports Triton or a kernel) when neither
    a CUDA device nor a working interpreter is there."""
    if not torch.cuda.is_available() and not INTERPRET:
        pytest.skip("needs a CUDA device (or Triton's interpreter: TRITON_INTERPRET=1)", allow_module_level=True)
    pytest.importorskip("triton")
    if INTERPRET and not INTERPRETER_WORKS:
        pytest.skip("Triton's interpreter needs numpy < 2.3", allow_module_level=True)
