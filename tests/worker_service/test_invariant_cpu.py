"""The CPU kernels of --deterministic (worker_service.invariant) give a row the same bits whatever else
the call holds: the product at 1 to 300 rows, at any row position, either way of summing, for any slice
of the weight's rows and over two ranks (row-parallel, gloo); SiLU; the int4 layers and the int8 head at
any step size. Each check also runs on the default kernel it replaces, which fails it (the control:
the check can fail). The default kernels that the mode keeps are held to the same property here."""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.net.ports import free_port
from worker_service import invariant
from worker_service.invariant import cpu_activation, cpu_products
from worker_service.layers import activation, linear
from worker_service.loader import quantized_cpu
from worker_service.loader.gguf_int4 import Int4Groups
from worker_service.loader.quantized_cpu import Int4Linear, Int8Head
from worker_service.parallel.distributed import destroy_tensor_parallel, init_tensor_parallel

NUM_ROWS = 300
ROW_COUNTS = [*range(1, 21), 31, 32, 33, 63, 64, 65, 100, 128, 199, 256, 299, 300]
# (K, N): where MKL's rows differ most (1024); the default model's down and q/k/v projections; a short last chunk
SHAPES = [(1024, 1024), (1536, 576), (576, 960), (96, 320)]

Kernel = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture
def deterministic() -> Iterator[None]:
    invariant.enable(torch.device("cpu"))
    yield
    invariant.disable()


def mismatched_calls(kernel: Kernel, x: torch.Tensor, counts: list[int] = ROW_COUNTS) -> list[tuple[int, int]]:
    """(rows, first row) of the calls of kernel on consecutive rows of x whose rows differ from the
    same rows computed one at a time."""
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(x.shape[0])])
    bad = []
    for count in counts:
        for start in sorted({0, (x.shape[0] - count) // 2, x.shape[0] - count}):
            if not torch.equal(kernel(x[start:start + count]), alone[start:start + count]):
                bad.append((count, start))
    return bad


def inputs(num_inputs: int, num_outputs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(NUM_ROWS, num_inputs, generator=generator),
            torch.randn(num_outputs, num_inputs, generator=generator) / num_inputs**0.5)


@pytest.mark.parametrize("column_major", [False, True])  # as loaded; as a deterministic worker lays it out
@pytest.mark.parametrize(("num_inputs", "num_outputs"), SHAPES)
def test_product_rows_do_not_depend_on_the_call(num_inputs: int, num_outputs: int, column_major: bool,
                                                monkeypatch) -> None:
    x, weight = inputs(num_inputs, num_outputs, num_inputs + num_outputs)
    if column_major:
        weight = weight.t().contiguous().t()
    assert mismatched_calls(lambda rows: cpu_products.linear(rows, weight), x) == []
    alone = torch.cat([cpu_products.linear(x[i:i + 1], weight) for i in range(NUM_ROWS)])
    for max_partials in (0, 1 << 40):  # every call accumulated with addmm; every call through the partials
        monkeypatch.setattr(cpu_products, "MAX_PARTIALS", max_partials)
        for count in (1, 5, 64, NUM_ROWS):
            assert torch.equal(cpu_products.linear(x[:count], weight), alone[:count])


@pytest.mark.parametrize(("num_inputs", "num_outputs"), SHAPES[:2])
def test_the_default_product_fails_the_same_check(num_inputs: int, num_outputs: int) -> None:
    x, weight = inputs(num_inputs, num_outputs, num_inputs + num_outputs)
    assert mismatched_calls(lambda rows: F.linear(rows, weight), x)


@pytest.mark.parametrize(("num_inputs", "num_outputs"), SHAPES)
def test_product_columns_do_not_depend_on_the_slice_of_the_weight(num_inputs: int, num_outputs: int) -> None:
    """Column-parallel ranks hold a slice of the output rows of W: their columns are one rank's. And the
    weight's layout (cpu_layout) changes no bit."""
    x, weight = inputs(num_inputs, num_outputs, 7)
    whole = cpu_products.linear(x, weight)
    assert torch.equal(cpu_products.linear(x, weight.t().contiguous().t()), whole)
    half = num_outputs // 2
    for start, stop in ((0, half), (half, num_outputs), (3, 50), (num_outputs - 64, num_outputs)):
        assert torch.equal(cpu_products.linear(x, weight[start:stop]), whole[:, start:stop])
        assert torch.equal(cpu_products.linear(x[:1], weight[start:stop]), whole[:1, start:stop])


def test_the_order_of_the_sums_is_the_documented_one() -> None:
    """The facts the two ways of summing rest on: index_add_ adds its slices one after another (from
    the zeros it starts with), and addmm adds a product to its accumulator as acc + product."""
    generator = torch.Generator().manual_seed(3)
    for count, rows, columns in ((16, 4, 576), (9, 4, 7), (24, 300, 47), (5, 33, 1), (2, 4, 49152), (40, 300, 1024)):
        partials = torch.randn(count, rows, columns, generator=generator)
        total = torch.zeros(rows, columns)
        for partial in partials:
            total = total + partial
        assert torch.equal(cpu_products._fold(partials), total)
    x, weight = inputs(640, 576, 5)
    acc = torch.randn(NUM_ROWS, 576, generator=generator)
    for columns in (slice(0, 64), slice(576, 640)):
        expected = acc + x[:, columns] @ weight[:, columns].t()
        assert torch.equal(torch.addmm(acc, x[:, columns], weight[:, columns].t()), expected)


def test_bias_and_out_and_leading_dimensions() -> None:
    x, weight = inputs(128, 64, 9)
    bias = torch.randn(64)
    product = cpu_products.linear(x, weight)
    expected = product + bias
    assert torch.equal(cpu_products.linear(x, weight, bias), expected)
    out = torch.empty(NUM_ROWS, 64)
    assert cpu_products.linear(x, weight, None, out) is out and torch.equal(out, product)
    assert torch.equal(cpu_products.linear(x.view(3, 100, 128), weight, bias), expected.view(3, 100, 64))


def _row_parallel_rank(rank: int, address: str, folder: Path) -> None:
    """One of two ranks: row_linear on its half of the inputs' columns, for several row counts."""
    init_tensor_parallel(rank, 2, address, torch.device("cpu"))
    try:
        results = {}
        for num_inputs, max_partials in ((384, cpu_products.MAX_PARTIALS), (2048, cpu_products.MAX_PARTIALS),
                                         (384, 4 * 3 * 64)):  # the last in blocks of 4 rows
            cpu_products.MAX_PARTIALS = max_partials
            x, weight = inputs(num_inputs, 64, num_inputs)
            bias = torch.arange(64.0)
            half = num_inputs // 2
            columns = slice(rank * half, (rank + 1) * half)
            for count in (1, 3, 4, 17, NUM_ROWS):
                results[(num_inputs, max_partials, count)] = cpu_products.row_linear(
                    x[:count, columns].contiguous(), weight[:, columns].contiguous(), bias)
        torch.save(results, folder / f"rank{rank}.pt")
    finally:
        destroy_tensor_parallel()


def test_row_parallel_product_over_two_ranks_is_one_ranks(tmp_path: Path) -> None:
    """Each rank's chunks' partials gathered and added in chunk order: the bits of one rank holding
    the whole weight, on both ranks."""
    context = multiprocessing.get_context("spawn")
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=_row_parallel_rank, args=(rank, address, tmp_path)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    both = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for (num_inputs, _, count), result in both[0].items():
        x, weight = inputs(num_inputs, 64, num_inputs)
        expected = cpu_products.linear(x[:count], weight, torch.arange(64.0))
        assert torch.equal(result, expected)
        assert torch.equal(both[1][(num_inputs, _, count)], expected)


def test_silu_rows_do_not_depend_on_the_call() -> None:
    """The tail of a contiguous stretch: torch's silu rounds it with its scalar formula, differently
    from the vector one for some inputs; the row alone has its tail where a row in a batch has none."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_ROWS, 2 * 100, generator=generator) * 4  # 100 outputs a row: tails inside rows
    assert mismatched_calls(cpu_activation.silu_and_mul, x) == []
    assert mismatched_calls(lambda rows: F.silu(rows.contiguous()), x)  # the control
    torch.testing.assert_close(cpu_activation.silu_and_mul(x), activation.silu_and_mul(x), rtol=1e-6, atol=1e-6)


def int4_layer(num_inputs: int, num_outputs: int) -> Int4Linear:
    rng = np.random.default_rng(0)
    groups = Int4Groups(codes=rng.integers(0, 16, (num_outputs, num_inputs)).astype(np.uint8),
                        scales=rng.random((num_outputs, num_inputs // 32)).astype(np.float32) / 8,
                        zeros=-rng.random((num_outputs, num_inputs // 32)).astype(np.float32))
    dense = linear.LinearBase(num_inputs, num_outputs)
    dense.weight.data = torch.from_numpy(groups.dequantize())
    return Int4Linear(dense, groups)


def test_int4_layer_rows_do_not_depend_on_the_step(deterministic: None) -> None:
    """Every step through the int4 kernel, whose rows were the same bits at every row count; by default
    steps of more than 16 rows take the float32 layer, another computation."""
    layer = int4_layer(256, 192)
    x = torch.randn(NUM_ROWS, 256, generator=torch.Generator().manual_seed(2))
    assert mismatched_calls(layer, x) == []
    invariant.disable()
    assert mismatched_calls(layer, x)


def test_int8_head_rows_do_not_depend_on_the_step(deterministic: None) -> None:
    generator = torch.Generator().manual_seed(0)
    dense = linear.LinearBase(576, 4096)
    dense.weight.data = torch.randn(4096, 576, generator=generator)
    head = Int8Head(dense)
    hidden = torch.randn(64, 576, generator=generator)
    counts = [1, 2, 3, 4, 7, 16, 17, 33, 64]
    assert mismatched_calls(head, hidden, counts) == []
    candidates = torch.randint(0, 4096, (1, 32), generator=generator)  # the exact pass alone, the same candidates
    assert mismatched_calls(lambda rows: cpu_products.candidate_logits(dense.weight, candidates.expand(len(rows), -1),
                                                                        rows), hidden, counts) == []
    invariant.disable()
    assert quantized_cpu.KERNELS["candidate_logits"] is quantized_cpu.candidate_logits
    assert mismatched_calls(head, hidden, counts)


@pytest.mark.parametrize("num_columns", [64, 576, 4096, 16384])
def test_the_norm_the_mode_keeps_is_row_invariant(num_columns: int) -> None:
    """Measured so, not by construction: F.rms_norm gives a row the same bits whatever rows come with it,
    for rows of up to 32,768 values (every model's hidden size; longer ones are split over threads)."""
    generator = torch.Generator().manual_seed(num_columns)
    x = torch.randn(65, num_columns, generator=generator) * 4
    weight = torch.randn(num_columns, generator=generator)
    assert mismatched_calls(lambda rows: F.rms_norm(rows, (num_columns,), weight, 1e-6), x, SAMPLER_ROWS) == []


SAMPLER_ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 17, 33, 65]


@pytest.mark.parametrize("num_columns", [509, 49152, 151936])
def test_the_sampler_kernels_are_row_invariant(num_columns: int) -> None:
    """Measured so, not by construction: the sampler's softmax, log_softmax, sort, topk and cumsum."""
    x = torch.randn(65, num_columns, generator=torch.Generator().manual_seed(num_columns)) * 4
    for kernel in (lambda rows: torch.softmax(rows, -1),
                   lambda rows: torch.log_softmax(rows, -1, dtype=torch.float32),
                   lambda rows: torch.softmax(rows, -1).cumsum(-1),
                   lambda rows: rows.sort(-1, descending=True).values,
                   lambda rows: rows.topk(20, -1).values):
        assert mismatched_calls(kernel, x, SAMPLER_ROWS) == []


def test_enable_swaps_the_tables_and_disable_puts_them_back() -> None:
    before = [dict(table) for table in (linear.KERNELS, activation.KERNELS, quantized_cpu.KERNELS)]
    invariant.enable(torch.device("cpu"))
    invariant.enable(torch.device("cpu"))  # idempotent
    try:
        assert invariant.is_enabled()
        assert linear.KERNELS["row_linear"] is not linear.reference_row_linear
        assert not quantized_cpu.KERNELS["dense_serves"](1000, 16)
    finally:
        invariant.disable()
    assert [dict(table) for table in (linear.KERNELS, activation.KERNELS, quantized_cpu.KERNELS)] == before
    with pytest.raises(ValueError, match="no batch-invariant kernels"):
        invariant.enable(torch.device("meta"))


def test_enable_on_the_cpu_pins_mkl_to_its_vector_isa_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """What this session's products were measured on (cpu_products.pin_mkl_code_path); a value the
    environment gives is kept."""
    monkeypatch.delenv("MKL_CBWR", raising=False)
    invariant.enable(torch.device("cpu"))
    invariant.disable()
    capability = torch.backends.cpu.get_cpu_capability()
    assert os.environ.get("MKL_CBWR") == (capability if capability in ("AVX512", "AVX2") else None)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    invariant.enable(torch.device("cpu"))
    invariant.disable()
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"


def test_prepare_lays_the_weights_out_column_major(tmp_path: Path) -> None:
    """The linears' and the head's weights (a tied one once), the same values; an Int8Head's keeps its rows."""
    from tests.tiny_models import make_tiny_checkpoint
    from worker_service.attention import get_attention_backend
    from worker_service.loader.model_loading import load_checkpoint

    path = make_tiny_checkpoint(tmp_path, "llama", tie=True, hidden_size=128, head_dim=32)
    model, _ = load_checkpoint(str(path), torch.float32, torch.device("cpu"), get_attention_backend("torch"))
    before = {name: param.clone() for name, param in model.named_parameters()}
    invariant.prepare(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])
        assert param.ndim == 1 or param.t().is_contiguous(), name
    dense = linear.LinearBase(64, 256)
    dense.weight.data = torch.randn(256, 64)
    head, other = Int8Head(dense), linear.LinearBase(64, 32)
    invariant.prepare(torch.nn.ModuleList([head, other]))
    assert head.dense.weight.is_contiguous() and other.weight.t().is_contiguous()
