"""The batch-invariant Triton kernels of `--deterministic`: a row's result is the same bits whatever
else is computed with it.

- The products (invariant/triton_products, the chain and the segmented one): every row of x W^T equals
  the same row of one large call, for call sizes from 1 row to thousands (every row tile, the segmented
  product's one-pass and partials paths), at any start row; a row-parallel split of K over "ranks"
  (each rank's segment partials, concatenated in rank order, added by sum_segments) equals the whole
  segmented product; both close to float64.
- The attention (attention/triton_invariant): each query row of a full prefill equals the same row
  computed as a decode token (alone, or batched with other sequences of other lengths) and inside
  prefill chunks of other sizes after a cached prefix.
The default kernels (cuBLAS, the skinny and split-K decode kernels) fail these checks on an H200:
that is what the mode exists for (bench/batch_invariance.py measures it end to end).

On a CUDA device; on the CPU through Triton's interpreter at small sizes (float16/float32), as the
other kernel tests.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.worker_service.triton_runtime import DEVICE, INTERPRET, skip_module_unless_kernels_run

skip_module_unless_kernels_run()

from tests.worker_service.test_triton_attention import PagedBatch, make_batch  # noqa: E402
from worker_service.attention import get_attention_backend  # noqa: E402
from worker_service.invariant import triton_products  # noqa: E402

pytestmark = pytest.mark.gpu

LOW = torch.float16 if INTERPRET else torch.bfloat16
SHAPES = [(64, 96), (256, 192)] if INTERPRET else [(1024, 3072), (3072, 1024), (2048, 1024), (1024, 151936 // 16)]
ROW_COUNTS = [1, 2, 3, 17, 40] if INTERPRET else [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 255, 256,
                                                  300, 512, 1000, 2047, 4096]


@pytest.mark.parametrize("product", ["linear", "segmented_linear"])
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
@pytest.mark.parametrize("k, n", SHAPES)
def test_product_rows_do_not_depend_on_the_batch(k: int, n: int, dtype: torch.dtype, product: str) -> None:
    generator = torch.Generator(DEVICE).manual_seed(k + n)
    total = max(ROW_COUNTS) + 5
    x = torch.randn(total, k, generator=generator, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, generator=generator, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, generator=generator, device=DEVICE).to(dtype)
    multiply = getattr(triton_products, product)
    whole = multiply(x, weight, bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.allclose(whole.double(), exact, atol=0.05 if dtype != torch.float32 else 1e-4, rtol=0.02)
    for rows in ROW_COUNTS:
        for start in sorted({0, 1, total - rows}):
            part = multiply(x[start:start + rows], weight, bias)
            assert torch.equal(part, whole[start:start + rows]), f"{rows} rows from row {start}"


@pytest.mark.parametrize("ranks", [2, 4])
def test_row_parallel_segments_sum_to_the_whole_product(ranks: int) -> None:
    """What row_linear does over `ranks` ranks (each holds K / ranks columns, computes its segments'
    partials; the gathered partials are added in rank order), without the collective."""
    k, n = (256, 96) if INTERPRET else (3072, 1024)
    generator = torch.Generator(DEVICE).manual_seed(ranks)
    x = torch.randn(37, k, generator=generator, device=DEVICE).to(LOW)
    weight = torch.randn(n, k, generator=generator, device=DEVICE).to(LOW)
    bias = torch.randn(n, generator=generator, device=DEVICE).to(LOW)
    width = k // ranks
    partials = torch.cat([triton_products.segment_partials(x[:, r * width:(r + 1) * width].contiguous(),
                                                           weight[:, r * width:(r + 1) * width].contiguous())
                          for r in range(ranks)])
    summed = triton_products.sum_segments(partials, bias, torch.empty(37, n, dtype=LOW, device=DEVICE))
    assert torch.equal(summed, triton_products.segmented_linear(x, weight, bias))


def _batch(base: PagedBatch, rows: list[tuple[int, int, int]]) -> PagedBatch:
    """A batch over base's caches: per entry (sequence, first query position, query length), that
    sequence's query rows at those positions (from base.q, a full prefill of every sequence)."""
    starts = [sum(base.query_lens[:seq]) for seq in range(len(base.seq_lens))]
    q = torch.cat([base.q[starts[seq] + first:starts[seq] + first + length] for seq, first, length in rows])
    tables = base.block_tables[[seq for seq, _, _ in rows]]
    return dataclasses.replace(base, q=q, block_tables=tables, seq_lens=[first + length for _, first, length in rows],
                               query_lens=[length for _, _, length in rows])


def _attend(batch: PagedBatch) -> torch.Tensor:
    backend = get_attention_backend("triton-invariant")
    return backend.attend(batch.q, batch.k_cache, batch.v_cache, batch.metadata(), 0.125)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention_rows_do_not_depend_on_the_batch(group: int) -> None:
    seq_lens = [70, 33, 129] if INTERPRET else [1500, 77, 700, 2049]
    base = make_batch(seq_lens, seq_lens, block_size=16, num_heads=2 * group, num_kv_heads=2,
                      head_dim=32 if INTERPRET else 128, dtype=LOW, seed=group)
    full = _attend(base)
    starts = [sum(seq_lens[:seq]) for seq in range(len(seq_lens))]
    positions = [0, 1, 31, 32, 63, 64, 65, seq_lens[0] - 1]
    # Decode rows: one token each, at many positions of sequence 0, beside other sequences' tokens.
    decode = _batch(base, [(0, p, 1) for p in positions] + [(seq, n - 1, 1) for seq, n in enumerate(seq_lens)])
    out = _attend(decode)
    for index, p in enumerate(positions):
        assert torch.equal(out[index], full[p]), f"decode row at position {p}"
    # Chunks: a cached prefix then chunks of other sizes, mixed with decode rows of the other sequences.
    for first, length in [(0, 5), (13, 50), (64, seq_lens[0] - 64), (seq_lens[0] - 40, 40)]:
        chunked = _attend(_batch(base, [(1, seq_lens[1] - 1, 1), (0, first, length), (2, seq_lens[2] - 2, 1)]))
        assert torch.equal(chunked[1:1 + length], full[first:first + length]), f"chunk at {first}, {length} rows"
        assert torch.equal(chunked[0], full[starts[1] + seq_lens[1] - 1])
