"""The Triton RMSNorm (with and without the residual add) against the eager one.

Runs on a CUDA device, or on the CPU through Triton's interpreter (tests/worker_service/triton_runtime.py).
"""
from __future__ import annotations

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from worker_service.layers import norm  # noqa: E402
from worker_service.layers.triton_norm import add_rms_norm, rms_norm  # noqa: E402

pytestmark = pytest.mark.gpu
# The interpreter truncates float32 -> bfloat16 instead of rounding: float16 stands in for it there.
DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 1024), (7, 1000), (3, 5, 128), (64, 4096)]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but where the float32 sum of squares, added in another order, moves a rounding
    boundary: at most one unit of the 16-bit output's precision, on few elements."""
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    if out.dtype != torch.float32:
        assert (out != expected).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_eager(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    _close(rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_matches_eager(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, residual = (torch.randn(shape, dtype=dtype, device=DEVICE) * 3 for _ in range(2))
    weight = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    out, total = add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_total = norm.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total)  # one rounded add, as eager
    _close(out, expected_out)


def test_strided_rows_and_empty_batch() -> None:
    base = torch.randn(6, 64 + 10, device=DEVICE)
    x = base[:, :64]  # rows with a stride wider than their length
    weight = torch.randn(64, device=DEVICE)
    _close(rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
    assert rms_norm(torch.empty(0, 64, device=DEVICE), weight, 1e-6).shape == (0, 64)
