"""Batch-invariant products on the CPU: a row's result is the same bits whatever the other rows of
the call are, however many there are, and at any tensor-parallel size.

Why: MKL's sgemm picks its kernel, and how it splits and orders the sum over the inner dimension K,
by the shape of the call. Measured with torch 2.13 (MKL 2024.2, AVX-512): a row of x @ W.T differs
between a call of 1 row (gemv), of 2 to 15 and of 16 or more, and at K = 1024 also among calls of 16
or more rows and with the row's position. So K is cut into CHUNK-column chunks, too short for MKL to
split, and the chunks' products are added one after another, in float32, from zero:

    x @ W.T = ((0 + P_0) + P_1) + ... + P_last,    P_c = x[:, c] @ W[:, c].T

Measured (and asserted by tests/worker_service/test_invariant_cpu.py): P_c is the same bits for any
number of rows from MIN_ROWS up, at any row position, for any slice of W's rows (so column-parallel
ranks, which hold N / ranks of them, agree with one rank), from a batched call (bmm) as from a 2D one,
and torch.addmm(acc, ...) gives acc + P_c. Calls of 1 or 2 rows give other bits (and the 2D product
of 3 rows did in an earlier measurement): shorter inputs are padded with zero rows to MIN_ROWS.

The sum is computed in one of two ways, the same bits (tested), chosen by the size of the call: few
rows materialise the partials (one batched product) and add them with index_add_, which adds its
slices one after another (torch.sum does not: over a last stretch of fewer than 16 elements it adds
in another order, so a row's sum would depend on where the row sits); many rows accumulate addmm
into a zeroed buffer chunk after chunk, without the partials (they would not fit in memory).

A row-parallel layer (RowLinear) over N ranks holds K / N columns of W, a whole number of chunks:
each rank computes its chunks' partials, the ranks gather them (rank order is chunk order), and every
rank adds all of them as above: the sum of one rank, exactly.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import torch

from worker_service.parallel.distributed import all_gather_rows, tp_size

CHUNK = 64  # columns of K per product; row-parallel ranks must hold whole chunks
MIN_ROWS = 4  # fewer rows change MKL's kernel (measured): inputs are padded to this many
# Calls whose partials (chunks x rows x outputs floats) fit in this many floats materialise them (one
# batched product and one sum: few ops, what decode steps need); larger ones accumulate with addmm.
MAX_PARTIALS = 1 << 21


def pin_mkl_code_path() -> None:
    """Asks MKL for its AVX-512 (or AVX2) code path, where the environment names none (MKL_CBWR).

    MKL otherwise chooses its kernels by the CPU's vendor as well as its vector ISA: on an AMD EPYC
    with AVX-512 its default path's rows moved with the call (8 of the 29 checks of
    tests/worker_service/test_invariant_cpu.py failed), its AVX-512 path's did not, as on Intel CPUs.
    MKL reads the variable at its first call: call this before any product of the process."""
    branch = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2" or another ISA (no MKL call)
    if branch in ("AVX512", "AVX2"):
        os.environ.setdefault("MKL_CBWR", branch)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) with x [..., K] and weight [N, K], each row's result independent of the others
    (written into out when one is given)."""
    rows = x.reshape(-1, x.shape[-1])
    result = _product(rows, weight).view(*x.shape[:-1], weight.shape[0])
    return _finish(result, bias, out)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel product: this rank holds columns [rank * K_local, ...) of W and of x; the result
    is that of one rank holding all of them (see the module docstring), on every rank."""
    if tp_size() == 1:
        return linear(x, weight, bias)
    num_inputs = x.shape[-1]
    if num_inputs % CHUNK:
        raise ValueError(f"deterministic tensor parallelism: a row-parallel rank's {num_inputs} inputs are "
                         f"not a multiple of {CHUNK}")
    rows = x.reshape(-1, num_inputs)
    num_chunks = num_inputs // CHUNK
    result = rows.new_empty((rows.shape[0], weight.shape[0]))
    block = max(MIN_ROWS, MAX_PARTIALS // (num_chunks * weight.shape[0]))
    for start, stop in _row_blocks(rows.shape[0], block):
        gathered = all_gather_rows(_chunk_partials(_padded(rows[start:stop]), weight))
        result[start:stop] = _fold(gathered.flatten(0, 1))[:stop - start]
    return _finish(result.view(*x.shape[:-1], weight.shape[0]), bias, None)


def candidate_logits(weight: torch.Tensor, candidates: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The float32 logits hidden[t] . weight[candidates[t, j]] ([tokens, num_candidates]), each summed
    over the hidden dimension one product after another (cumsum: sequential, in double for float32),
    so that a token's logits never depend on how many tokens came with it (Int8Head's exact pass)."""
    products = weight[candidates] * hidden[:, None, :]  # [tokens, num_candidates, hidden]
    return products.cumsum(-1)[..., -1]


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in the fixed order of the module docstring."""
    num_rows, num_inputs = x.shape
    if weight.shape[1] != num_inputs:
        raise ValueError(f"input of {num_inputs} features for a weight of shape {tuple(weight.shape)}")
    padded = _padded(x)
    num_chunks = -(-num_inputs // CHUNK)
    if num_chunks * padded.shape[0] * weight.shape[0] <= MAX_PARTIALS:
        total = _fold(_chunk_partials(padded, weight))
    else:
        total = _accumulated(padded, weight)
    return total[:num_rows]


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x, contiguous, with zero rows added up to MIN_ROWS."""
    if x.shape[0] >= MIN_ROWS:
        return x.contiguous()
    padded = x.new_zeros((MIN_ROWS, x.shape[1]))
    padded[:x.shape[0]] = x
    return padded


def _chunk_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[num_chunks, M, N]: each chunk's product x[:, c] @ weight[:, c]^T (the last chunk may be shorter)."""
    num_rows, num_inputs = x.shape
    num_whole = num_inputs // CHUNK
    partials = x.new_empty((-(-num_inputs // CHUNK), num_rows, weight.shape[0]))
    if num_whole:
        width = num_whole * CHUNK
        x_chunks = x[:, :width].unflatten(1, (num_whole, CHUNK)).transpose(0, 1)  # [C, M, CHUNK]
        w_chunks = weight[:, :width].unflatten(1, (num_whole, CHUNK)).permute(1, 2, 0)  # [C, CHUNK, N]
        torch.bmm(x_chunks, w_chunks, out=partials[:num_whole])
    if num_inputs % CHUNK:
        torch.matmul(x[:, num_whole * CHUNK:], weight[:, num_whole * CHUNK:].t(), out=partials[num_whole])
    return partials


def _fold(partials: torch.Tensor) -> torch.Tensor:
    """[M, N]: the partials [num_chunks, M, N] added one after another from zero."""
    total = partials.new_zeros((1, partials[0].numel()))
    total.index_add_(0, _zeros_index(partials.shape[0], partials.device), partials.reshape(partials.shape[0], -1))
    return total.view(partials.shape[1:])


@functools.cache
def _zeros_index(length: int, device: torch.device) -> torch.Tensor:
    """index_add_'s index that sends every slice to row 0 (made once per length: every call needs one)."""
    return torch.zeros(length, dtype=torch.int64, device=device)


def _accumulated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """_fold(_chunk_partials(x, weight)) without the partials: addmm into a zeroed buffer, one chunk
    after another (addmm adds the chunk's product to the buffer as acc + P_c: asserted by a test)."""
    total = x.new_zeros((x.shape[0], weight.shape[0]))
    for start in range(0, x.shape[1], CHUNK):
        torch.addmm(total, x[:, start:start + CHUNK], weight[:, start:start + CHUNK].t(), out=total)
    return total


def _row_blocks(num_rows: int, block: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of consecutive blocks of at most `block` rows covering num_rows."""
    for start in range(0, num_rows, block):
        yield start, min(start + block, num_rows)


def _finish(result: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """The bias added after the whole sum, written into out when one is given."""
    if bias is not None:
        result = result + bias
    if out is None:
        return result
    return out.copy_(result)
