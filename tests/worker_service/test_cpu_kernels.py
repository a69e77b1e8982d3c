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


def test_a_cpu_model_runs_after_a_gpu_worker_enabled_the_fused_kernels(tmp_path, monkeypatch) -> None:
    """The kernel tables are process-wide: once a GPU worker (or a GPU LLM) has installed its
    kernels, a CPU model in the same process must still run, on the reference kernels' bits."""
    pytest.importorskip("triton")
    from common import SamplingParams
    from offline import LLM
    from tests.tiny_models import make_tiny_checkpoint
    from worker_service.layers import activation, fused_kernels, linear, triton_activation, triton_norm

    model = make_tiny_checkpoint(tmp_path, "qwen3")
    prompts, greedy = [[5, 17, 99, 3], list(range(40, 70))], SamplingParams(temperature=0, max_tokens=6)

    def generate() -> list[list[int]]:
        with LLM(str(model), block_size=16, num_kv_blocks=32, device="cpu") as llm:
            return [r["token_ids"] for r in llm.generate(prompts, greedy, use_tqdm=False)]

    expected = generate()
    for table in (norm.KERNELS, rotary.KERNELS, activation.KERNELS, linear.KERNELS):
        for name, kernel in table.items():
            monkeypatch.setitem(table, name, kernel)  # restored afterwards
    monkeypatch.setattr(fused_kernels, "_enabled", False)

    def gpu_only(x: torch.Tensor, *args: object) -> torch.Tensor:
        raise AssertionError("a GPU kernel got a CPU tensor")  # Triton's interpreter would run it here

    for module, name in ((triton_norm, "rms_norm"), (triton_norm, "add_rms_norm"), (triton_activation, "silu_and_mul")):
        monkeypatch.setattr(module, name, gpu_only)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    fused_kernels.enable()
    assert generate() == expected
