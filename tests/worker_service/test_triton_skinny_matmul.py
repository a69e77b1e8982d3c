"""The Triton skinny matmul against F.linear in float32, and which calls the linear layers send to it.

Runs on a CUDA device, or on the CPU through Triton's interpreter with TRITON_INTERPRET=1 (set by
conftest.py where it works: Triton installed, numpy < 2.3), there at small shapes: the interpreter
runs each program as numpy, a few milliseconds apiece.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from worker_service.layers import activation, linear, norm  # noqa: E402
from worker_service.layers import triton_skinny_matmul as skinny  # noqa: E402
from worker_service.layers.triton_activation import silu_and_mul  # noqa: E402
from worker_service.layers.triton_skinny_matmul import (  # noqa: E402
    MAX_ROWS,
    SkinnyConfig,
    skinny_linear,
    skinny_norm_linear,
    skinny_silu_linear,
    use_skinny,
)

pytestmark = pytest.mark.gpu
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA device")

# Qwen3-0.6B's projections (gate_up, qkv, o, down), a 7B-sized gate_up and square one, an N that no
# block divides; on the interpreter, small ones that still cover a masked K and a partial last block.
SHAPES = [(6144, 1024), (4096, 1024), (1024, 2048), (1024, 3072), (24576, 4096), (4096, 4096), (1000, 1024)]
SMALL_SHAPES = [(40, 64), (20, 200), (3, 1024)]
# One unit of the last place: the one rounding of the float32 sum is half of one, and the interpreter
# truncates to bfloat16 instead of rounding.
TOLERANCE = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def inputs(m: int, n: int, k: int, dtype: torch.dtype, has_bias: bool, seed: int = 0,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if has_bias else None
    return x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE)


def check_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    expected = reference(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == x.dtype
    # float32 sums differ from the reference's only in their order; the one rounding to 16 bits dominates.
    tolerance = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=1e-3)


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES if INTERPRET else SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
def test_matches_float32_reference(m: int, shape: tuple[int, int], has_bias: bool) -> None:
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    x, weight, bias = inputs(m, *shape, dtype, has_bias, seed=m)
    check_close(skinny_linear(x, weight, bias), x, weight, bias)


# Configurations other than _config's for these shapes: several rows a program with a partial last
# block, K in several masked steps, the tensor-core path at few rows and with a bias.
@pytest.mark.parametrize(("m", "n", "k", "config"), [
    (3, 30, 72, SkinnyConfig(8, 32, 4, 1, False)),
    (1, 17, 64, SkinnyConfig(4, 16, 2, 2, False)),
    (2, 40, 80, SkinnyConfig(16, 32, 4, 3, True)),
    (16, 50, 96, SkinnyConfig(32, 64, 4, 2, True)),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_configs(m: int, n: int, k: int, config: SkinnyConfig, dtype: torch.dtype) -> None:
    if INTERPRET and config.use_dot and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 tl.dot is wrong (see test_triton_attention.py)")
    x, weight, bias = inputs(m, n, k, dtype, has_bias=True, seed=n)
    check_close(skinny_linear(x, weight, bias, config), x, weight, bias)


def test_leading_dimensions_and_strided_rows() -> None:
    x, weight, bias = inputs(6, 24, 64, torch.float16, has_bias=True)
    batched = x.view(2, 3, 64)
    out = skinny_linear(batched, weight, bias)
    assert out.shape == (2, 3, 24)
    check_close(out.view(6, 24), x, weight, bias)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 apart
    check_close(skinny_linear(wide, weight, bias), x, weight, bias)
    assert skinny_linear(x[:0], weight).shape == (0, 24)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(x, torch.cat([weight, weight], dim=1)[:, ::2])


# The norm in the prologue: the CUDA-core path in one K step and in several masked ones, the
# tensor-core path in several; on a GPU _config's own choices at Qwen3-0.6B's shapes.
NORM_CASES = [(1, 40, 64, SkinnyConfig(8, 64, 4, 1, False)), (2, 24, 200, SkinnyConfig(8, 64, 4, 1, False)),
              (5, 40, 96, SkinnyConfig(16, 32, 4, 2, True))]
if not INTERPRET:
    NORM_CASES += [(1, 6144, 1024, None), (2, 4096, 1024, None), (4, 4096, 1024, None), (16, 6144, 1024, None)]


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "config"), NORM_CASES)
def test_norm_in_the_prologue_matches_the_norm_then_the_product(m: int, n: int, k: int, config: SkinnyConfig | None,
                                                                 has_residual: bool) -> None:
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    x, weight, bias = inputs(m, n, k, dtype, has_bias=True, seed=k)
    generator = torch.Generator().manual_seed(m)
    residual = torch.randn(m, k, generator=generator).to(dtype).to(DEVICE) if has_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=generator)).to(dtype).to(DEVICE)
    out, total = skinny_norm_linear(x, residual, norm_weight, 1e-6, weight, bias, config)
    if residual is None:
        normed, expected_total = norm.rms_norm(x, norm_weight, 1e-6), x
    else:
        normed, expected_total = norm.add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(total, expected_total)  # the residual stream: the same rounding, bit for bit
    check_close(out, normed, weight, bias)


def test_normed_linear_composes_on_the_cpu_and_for_other_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU entry hands CPU tensors, and layers that are not column-parallel, to the norm and then
    the layer (the kernel is never called): the same bits as the reference composition."""
    monkeypatch.setitem(linear.KERNELS, "normed_linear", skinny.normed_linear)

    def kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused kernel got a call it must not take")

    monkeypatch.setattr(skinny, "skinny_norm_linear", kernel)
    rms = norm.RMSNorm(64)
    rms.weight.data.normal_()
    x, residual = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()  # 16-bit: only the device says no
    rms = rms.bfloat16()
    for layer in (linear.MergedColumnLinear(64, [16, 16]).bfloat16(), linear.RowLinear(64, 32).bfloat16()):
        layer.weight.data.normal_()
        expected = linear.compose_normed_linear(x, residual, rms, layer)
        got = linear.normed_linear(x, residual, rms, layer)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@on_gpu
def test_normed_linear_takes_the_kernel_for_column_parallel_layers_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(linear.KERNELS, "normed_linear", skinny.normed_linear)
    layer = linear.MergedColumnLinear(1024, [512, 512]).to(device="cuda", dtype=torch.bfloat16)
    rms = norm.RMSNorm(1024).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.normal_(std=1 / 32), rms.weight.data.normal_(1, 0.1)
    x, residual = (torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, total = linear.normed_linear(x, residual, rms, layer)
    fused_out, fused_total = skinny_norm_linear(x, residual, rms.weight, rms.eps, layer.weight)
    assert torch.equal(out, fused_out) and torch.equal(total, fused_total)


# SiLU-and-mul in the prologue: the CUDA-core path in one K step and in several masked ones, the
# tensor-core path in several; on a GPU _config's choices at Qwen3-0.6B's down_proj (K = 3072).
GATED_CASES = [(1, 40, 64, SkinnyConfig(8, 64, 4, 1, False)), (2, 24, 200, SkinnyConfig(8, 64, 4, 1, False)),
               (5, 40, 96, SkinnyConfig(16, 32, 4, 2, True))]
if not INTERPRET:
    GATED_CASES += [(1, 1024, 3072, None), (2, 1024, 3072, None), (4, 1024, 3072, None), (16, 1024, 3072, None)]


@pytest.mark.parametrize(("m", "n", "k", "config"), GATED_CASES)
def test_silu_and_mul_in_the_prologue_is_the_activation_then_the_product(m: int, n: int, k: int,
                                                                         config: SkinnyConfig | None) -> None:
    """Bit for bit the Triton activation kernel's output through the same product."""
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    gate_up, weight, bias = inputs(m, n, 2 * k, dtype, has_bias=True, seed=k)
    weight = weight[:, :k].contiguous()
    activated = silu_and_mul(gate_up)
    out = skinny_silu_linear(gate_up, weight, bias, config)
    assert torch.equal(out, skinny_linear(activated, weight, bias, config))
    check_close(out, activation.silu_and_mul(gate_up), weight, bias)
    assert skinny_silu_linear(gate_up.view(1, m, 2 * k), weight).shape == (1, m, n)


def test_silu_and_mul_linear_composes_on_the_cpu_and_for_other_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU entry hands CPU tensors, float32 and layers other than an unsharded RowLinear to the
    activation and then the layer (the kernel is never called): the same bits as the composition."""
    monkeypatch.setitem(linear.KERNELS, "silu_and_mul_linear", skinny.silu_and_mul_linear)

    def kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused kernel got a call it must not take")

    monkeypatch.setattr(skinny, "skinny_silu_linear", kernel)
    for dtype in (torch.bfloat16, torch.float32):
        gate_up = torch.randn(2, 128).to(dtype)
        for layer in (linear.RowLinear(64, 32).to(dtype), linear.MergedColumnLinear(64, [16, 16]).to(dtype)):
            layer.weight.data.normal_()
            expected = layer(activation.silu_and_mul(gate_up))
            assert torch.equal(linear.silu_and_mul_linear(gate_up, layer), expected)


@on_gpu
def test_silu_and_mul_linear_takes_the_kernel_for_row_linear_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(linear.KERNELS, "silu_and_mul_linear", skinny.silu_and_mul_linear)
    layer = linear.RowLinear(3072, 1024).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.normal_(std=1 / 64)
    gate_up = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear.silu_and_mul_linear(gate_up, layer), skinny_silu_linear(gate_up, layer.weight))
    many = torch.randn(32, 6144, device="cuda", dtype=torch.bfloat16)  # past MAX_ROWS: the composition
    assert torch.equal(linear.silu_and_mul_linear(many, layer), linear.compose_silu_and_mul_linear(many, layer))


def test_configs_fit_the_shapes() -> None:
    """Every config of the served range is one the kernel can run: powers of two, dot operands of 16
    and more, tensor cores from three rows on, and enough programs for the CUDA-core kernel."""
    for m in range(1, skinny.MAX_ROWS + 1):
        for n, k in SHAPES:
            block_n, block_k, num_warps, num_stages, use_dot = skinny._config(m, n, k)
            assert all(value & (value - 1) == 0 for value in (block_n, block_k, num_warps))
            assert num_stages >= 1 and block_k <= skinny.MAX_BLOCK_K
            assert not use_dot or min(block_n, block_k) >= 16
            assert use_dot == (m > 2)
            assert use_dot or -(-n // block_n) >= min(skinny.TARGET_PROGRAMS, n // 16)


def test_use_skinny_on_the_cpu_is_false() -> None:
    x, weight = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert not use_skinny(x, weight)


@on_gpu
def test_use_skinny_decisions() -> None:
    def case(m: int, k: int = 64, dtype: torch.dtype = torch.bfloat16, weight_dtype: torch.dtype | None = None,
             transposed: bool = False, leading: tuple[int, ...] = ()) -> bool:
        x = torch.zeros(*leading, m, k, dtype=dtype, device="cuda")
        weight_dtype = weight_dtype or dtype
        weight = (torch.zeros(k, 32, dtype=weight_dtype, device="cuda").t() if transposed
                  else torch.zeros(32, k, dtype=weight_dtype, device="cuda"))
        return use_skinny(x, weight)

    assert case(1) and case(16) and case(5, dtype=torch.float16) and case(4, leading=(2,))
    assert not case(17) and not case(0) and not case(9, leading=(2,))  # 0 rows, more than MAX_ROWS
    assert not case(1, dtype=torch.float32) and not case(1, weight_dtype=torch.float16)
    assert not case(1, k=60)  # rows of K not 16-byte multiples
    assert not case(1, transposed=True)  # a non-contiguous weight


def test_layers_fall_back_to_f_linear_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The skinny-aware KERNELS entry (installed on GPUs) hands CPU tensors to F.linear: the same bits
    either way."""
    layer = linear.LinearBase(64, 32, bias=True)
    layer.weight.data.normal_(), layer.bias.data.normal_()
    x = torch.randn(3, 64)
    expected = F.linear(x, layer.weight, layer.bias)
    monkeypatch.setitem(linear.KERNELS, "linear", linear.reference_linear)  # a GPU test may have installed the kernel
    assert torch.equal(layer(x), expected)
    monkeypatch.setitem(linear.KERNELS, "linear", skinny.linear)
    assert torch.equal(layer(x), expected)
    x16, weight16 = x.bfloat16(), layer.weight.bfloat16()
    assert torch.equal(skinny.linear(x16, weight16), F.linear(x16, weight16))


@pytest.mark.parametrize("rows", [3, MAX_ROWS + 1])  # the kernel, then the reference's matmul
def test_writes_into_a_given_out(rows: int) -> None:
    """Tensor parallelism has the row-parallel products written straight into the buffer it sums
    (distributed.partial_sum_buffer): the same bits as without `out`, in `out`."""
    x, weight, _ = inputs(rows, 96, 64, torch.bfloat16, has_bias=False)
    buffer = torch.full((rows * 96 + 8,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = buffer[:rows * 96].view(rows, 96)
    for product in (skinny.linear, linear.reference_linear) + ((skinny_linear,) if rows <= MAX_ROWS else ()):
        out.fill_(float("nan"))
        result = product(x, weight, None, out=out)
        assert result.data_ptr() == buffer.data_ptr() and result.shape == (rows, 96)
        assert torch.equal(result, product(x, weight, None))
    with pytest.raises(ValueError, match="out"):
        skinny_linear(x, weight, out=buffer[:rows * 95].view(rows, 95))


@on_gpu
def test_layers_take_the_kernel_on_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(linear.KERNELS, "linear", skinny.linear)
    layer = linear.RowLinear(1024, 256, bias=True).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.normal_(std=1 / 32), layer.bias.data.normal_()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    assert torch.equal(out, skinny_linear(x, layer.weight, layer.bias))
    check_close(out, x, layer.weight, layer.bias)
    many = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)  # past MAX_ROWS: cuBLAS
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))


@on_gpu
def test_captured_in_a_cuda_graph_and_deterministic() -> None:
    x, weight, bias = inputs(4, 3072, 1024, torch.bfloat16, has_bias=True)
    eager = skinny_linear(x, weight, bias)  # the warm-up compiles, as before a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_linear(x, weight, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, skinny_linear(x, weight, bias))
    assert not torch.equal(captured, eager)
    check_close(captured, x, weight, bias)
