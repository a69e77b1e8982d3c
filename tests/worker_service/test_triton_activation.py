"""The Triton SiLU-and-mul against the eager one.

Runs on a CUDA device, or on the CPU through Triton's interpreter with TRITON_INTERPRET=1 (which
needs numpy < 2.3, see tests/worker_service/test_triton_attention.py).
"""
from __future__ import annotations

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from worker_service.layers.activation import silu_and_mul as eager_silu_and_mul  # noqa: E402
from worker_service.layers.triton_activation import silu_and_mul  # noqa: E402

pytestmark = pytest.mark.gpu
# The interpreter truncates float32 -> bfloat16 instead of rounding: float16 stands in for it there.
DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 8), (7, 2 * 1000), (3, 5, 2 * 1536), (256, 2 * 3072)])
def test_matches_eager(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if INTERPRET and shape[0] == 256:
        shape = (16, *shape[1:])
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 4
    expected = eager_silu_and_mul(x)
    out = silu_and_mul(x)
    assert out.shape == expected.shape and out.dtype == dtype
    # silu's float32 formula may differ in the last bits (x / (1 + exp(-x)), as torch's CUDA kernel;
    # torch's CPU kernel multiplies by the sigmoid); in a 16-bit dtype that shows only where the
    # rounding sits on a boundary: at most one unit of the output's precision, on few elements.
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)
    if dtype != torch.float32:
        assert (out != expected).float().mean().item() < 0.01


def test_strided_rows_and_bad_width() -> None:
    base = torch.randn(6, 2 * 64 + 10, device=DEVICE)
    x = base[:, :2 * 64]  # rows with a stride wider than their length
    torch.testing.assert_close(silu_and_mul(x), eager_silu_and_mul(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
