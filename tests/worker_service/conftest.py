"""Sets TRITON_INTERPRET for CPU-only machines before any kernel module is imported (see
triton_runtime.py)."""
from tests.worker_service import triton_runtime  # noqa: F401
