"""Without a CUDA device, the Triton kernels' tests run on the CPU through Triton's interpreter, at
small sizes, whenever it can run here: Triton installed (the dev extra brings it) and numpy below
2.3 (Triton 3.6's interpreter calls int() on one-element arrays, an error since numpy 2.3). Set
before any kernel module is imported: `triton.jit` reads it when a kernel is defined."""
from __future__ import annotations

import importlib.util
import os

import numpy
import torch

_NUMPY_VERSION = tuple(int(part) for part in numpy.__version__.split(".")[:2])
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None and _NUMPY_VERSION < (2, 3):
    os.environ.setdefault("TRITON_INTERPRET", "1")
