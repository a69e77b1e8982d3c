"""The CPU kernels (fewer ops) give the same bits as the reference kernels they replace, and
a worker starting on a CPU installs them (fused_kernels.enable_for)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from worker_service.layers import cpu_kernels, norm, rotary  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (7, 9, 64), (3, 128)])
def test_rms_norm_is_bit_identical(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=generator) * 30
    residual = torch.randn(shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator)
    assert torch.equal(cpu_kernels.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
    for ours, reference in zip(cpu_kernels.add_rms_norm(x, residual, weight, 1e-6),
                               norm.add_rms_norm(x, residual, weight, 1e-6), strict=True):
        assert torch.equal(ours, reference)


def test_rotary_is_bit_identical_on_strided_views() -> None:
    table = rotary.RotaryEmbedding(64, 2048, 10000.0)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=torch.Generator().manual_seed(0)) * 4
    # q and k as the attention layer passes them: views of the fused projection's output
    q, k = qkv[:, :576].reshape(5, 9, 64), qkv[:, 576:768].reshape(5, 3, 64)
    positions = torch.tensor([0, 3, 100, 2047, 7])
    ours = cpu_kernels.apply_rotary(positions, q, k, table.cos, table.sin)
    reference = rotary.apply_rotary(positions, q, k, table.cos, table.sin)
    for a, b in zip(ours, reference, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_other_dtypes_take_the_reference_path() -> None:
    x = torch.randn(4, 32).to(torch.bfloat16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    assert torch.equal(cpu_kernels.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))
