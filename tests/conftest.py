"""Set before anything imports numpy or calls MKL (pytest reads this file before it imports a test module).

Triton's interpreter, which runs the kernel tests on CPUs, computes each tl.dot with numpy's matmul.
OpenBLAS's FMA kernels (its Haswell and Zen cores) round a row of a product differently by the row's
place among the others, so the batch-invariance tests (tests/worker_service/test_triton_invariant.py),
which put one row at different places, would see the emulation's rounding rather than the kernels'
tiling. Its AVX core (Sandybridge, which every x86-64 CPU since 2011 runs) computes each row the same
wherever it sits: it is set here even where the environment names another (some machines set Haswell).
"""
from __future__ import annotations

import os
import platform
import sys

if platform.machine() in ("x86_64", "AMD64") and "numpy" not in sys.modules:
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

try:  # the deterministic CPU kernels' MKL code path, as a deterministic worker sets it at its start
    from worker_service.invariant.cpu_products import pin_mkl_code_path
except ImportError:  # no torch: the scheduler's own environment
    pass
else:
    pin_mkl_code_path()
