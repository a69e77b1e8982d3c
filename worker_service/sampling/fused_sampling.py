"""Temperature sampling in one pass over the logits: a fused Gumbel-max kernel in Triton.

For each row, argmax(logits / T + G) with G i.i.d. Gumbel(0, 1) picks token i with probability
softmax(logits / T)_i; rows with inverse temperature 0 are greedy and take the plain argmax. The
kernel reads the logits once in their own dtype and draws its noise from Philox, which is
counter-based: the noise of element (row, column) depends only on (seed, row, column), so there is
no generator state to advance and no host synchronisation.

Grid (num_rows, num_chunks). Each program scans one chunk of its row's vocabulary in tiles of BLOCK
columns and writes the chunk's best (score, column) to a small workspace; a second tiny kernel
reduces the chunks of each row to one token id. Ties go to the lowest column, as with torch.argmax.

Scores are kept in log2 units (logit / T * log2(e) + G * log2(e); the argmax is the same), so
that on CUDA each logarithm is one lg2.approx instruction. G = -ln(E) with E = -ln(U) ~ Exp(1), and
U = (k + 1/2) / 2^32 for 32 random bits k. The winning draws are the smallest E, from U near 1,
where float32 cannot tell U from 1: there E comes from a series in 1 - U = (2^32 - k - 1/2) / 2^32,
which float32 holds to full precision; elsewhere from log(U). Either way E is positive and finite,
so the noise is finite and a finite logit never scores NaN or +inf; a NaN score (from a NaN logit)
never replaces the best.

Imported only when logits are on CUDA, or when TRITON_INTERPRET=1 runs Triton on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from worker_service.layers.fused_kernels import num_sms
from worker_service.sampling import FUSED_SAMPLING_DTYPES

BLOCK = 4096  # columns per tile: a quarter (one Philox output) is 8 columns, 16 bytes of bf16, a thread
NUM_WARPS = 4
TARGET_WAVES = 3  # aim for this many programs per multiprocessor
INTERPRETER_NUM_SMS = 4  # keeps the grid small when Triton's interpreter runs it on the CPU
REDUCE_BLOCK = 32  # chunks per step of the reduction
NO_COLUMN = tl.constexpr(2**31 - 1)  # the column of a best that has seen no finite or infinite score


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:
        return libdevice.fast_log2f(x)  # one lg2.approx instruction instead of ~30 for the exact one
    else:
        return tl.log2(x)


@triton.jit
def _gumbel_log2(bits, FAST_LOG: tl.constexpr):
    """Gumbel(0, 1) noise divided by ln 2 (less a constant), from uint32 random bits: -log2(E) with
    E = -ln(U) ~ Exp(1) for U uniform in (0, 1)."""
    # Both are exact up to float32 rounding, which loses nothing near 0 (only near 1).
    w = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 1 - U
    u = ((bits ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # U
    # The smallest E win, and come from U near 1: there -ln(U) = -ln(1 - w) = w + w^2/2 + w^3/3 + ...,
    # whose first eight terms are exact to float32 below w = 1/8 (and log(U) is good above, where U
    # is below 7/8). Both branches are E * log2(e).
    series = w * (1.0 + w * (1 / 2 + w * (1 / 3 + w * (1 / 4 + w * (1 / 5 + w * (1 / 6 + w * (1 / 7 + w / 8)))))))
    exponential = tl.where(w < 0.125, series * 1.4426950408889634, -_log2(u, FAST_LOG))
    return -_log2(exponential, FAST_LOG)


@triton.jit
def _update_best(best_value, best_column, row_ptr, columns, begin, end, scale, bits,
                 IS_SAMPLED: tl.constexpr, FAST_LOG: tl.constexpr):
    """Folds one quarter-tile of a row into the per-lane running best (columns in [begin, end) only)."""
    mask = (columns >= begin) & (columns < end)
    score = tl.load(row_ptr + columns, mask=mask, other=float("-inf")).to(tl.float32)
    if IS_SAMPLED:
        score = score * scale + _gumbel_log2(bits, FAST_LOG)
    score = tl.where(mask, score, float("-inf"))
    # Strictly greater: each lane sees its columns in increasing order, so ties keep the lowest one,
    # and a NaN never wins.
    is_better = score > best_value
    return tl.where(is_better, score, best_value), tl.where(is_better, columns, best_column)


@triton.jit
def _scan_chunk(row_ptr, start, begin, end, scale, seed, counter_base,
                IS_SAMPLED: tl.constexpr, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    """The best (score, column) of columns [max(start, begin), end) of one row; start is a multiple
    of BLOCK, row_ptr points at column 0. Sampled scores are logit * scale + noise, in log2 units;
    greedy ones the plain logits."""
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best_value = tl.full([QUARTER], float("-inf"), dtype=tl.float32)
    best_column = tl.full([QUARTER], NO_COLUMN, dtype=tl.int32)  # no column yet
    for tile_start in range(start, end, BLOCK):
        # One Philox call gives four 32-bit outputs: output j is the noise of the tile's j-th quarter.
        if IS_SAMPLED:
            bits0, bits1, bits2, bits3 = tl.randint4x(seed, counter_base + tile_start // 4 + lanes)
        else:  # greedy: no noise (the bits are not read)
            bits0 = lanes
            bits1 = lanes
            bits2 = lanes
            bits3 = lanes
        columns = tile_start + lanes
        best_value, best_column = _update_best(best_value, best_column, row_ptr, columns, begin, end, scale, bits0,
                                               IS_SAMPLED, FAST_LOG)
        best_value, best_column = _update_best(best_value, best_column, row_ptr, columns + QUARTER, begin, end,
                                               scale, bits1, IS_SAMPLED, FAST_LOG)
        best_value, best_column = _update_best(best_value, best_column, row_ptr, columns + 2 * QUARTER, begin, end,
                                               scale, bits2, IS_SAMPLED, FAST_LOG)
        best_value, best_column = _update_best(best_value, best_column, row_ptr, columns + 3 * QUARTER, begin, end,
                                               scale, bits3, IS_SAMPLED, FAST_LOG)
    value = tl.max(best_value, axis=0)
    column = tl.min(tl.where(best_value == value, best_column, NO_COLUMN), axis=0)
    return value, column


@triton.jit(do_not_specialize=["seed", "num_chunks", "column_offset", "column_end"])  # one kernel for any
def _gumbel_chunk_kernel(
    logits_ptr, inv_temperatures_ptr, partial_value_ptr, partial_column_ptr,
    column_offset, column_end, vocab_size, chunk_size, seed, stride_logits_row, num_chunks,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
):
    """Columns [column_offset, column_end) of a vocabulary of vocab_size; the logits hold only those."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    start = (column_offset // BLOCK) * BLOCK + chunk * chunk_size  # whole tiles of the whole vocabulary
    end = tl.minimum(start + chunk_size, column_end)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits_row - column_offset  # at column 0
    # Philox counters: BLOCK // 4 per tile, tiles numbered from the row's start, so a token's noise
    # does not depend on the chunking (and so not on the device's multiprocessor count) nor on the
    # slice of the vocabulary these logits hold.
    counter_base = row.to(tl.int64) * (tl.cdiv(vocab_size, BLOCK) * (BLOCK // 4))
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    if inv_temperature > 0.0:
        scale = inv_temperature * 1.4426950408889634  # log2(e): the noise is in log2 units too
        value, column = _scan_chunk(row_ptr, start, column_offset, end, scale, seed, counter_base, True, FAST_LOG,
                                    BLOCK)
    else:
        value, column = _scan_chunk(row_ptr, start, column_offset, end, inv_temperature, seed, counter_base, False,
                                    FAST_LOG, BLOCK)
    partial = row.to(tl.int64) * num_chunks + chunk
    tl.store(partial_value_ptr + partial, value)
    tl.store(partial_column_ptr + partial, column.to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks"])
def _reduce_chunks_kernel(partial_value_ptr, partial_column_ptr, token_ids_ptr, values_ptr, num_chunks,
                          BLOCK_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_CHUNKS)
    best_value = tl.full([BLOCK_CHUNKS], float("-inf"), dtype=tl.float32)
    best_column = tl.full([BLOCK_CHUNKS], NO_COLUMN, dtype=tl.int64)
    # Chunks in increasing order, as columns in the scan: ties keep the lowest column.
    for first in range(0, num_chunks, BLOCK_CHUNKS):
        chunks = first + lanes
        mask = chunks < num_chunks
        offsets = row.to(tl.int64) * num_chunks + chunks
        values = tl.load(partial_value_ptr + offsets, mask=mask, other=float("-inf"))
        columns = tl.load(partial_column_ptr + offsets, mask=mask, other=NO_COLUMN)
        is_better = values > best_value
        best_value = tl.where(is_better, values, best_value)
        best_column = tl.where(is_better, columns, best_column)
    value = tl.max(best_value, axis=0)
    column = tl.min(tl.where(best_value == value, best_column, NO_COLUMN), axis=0)
    # Only a row whose every score is -inf (or NaN) has no best column: take 0, as torch.argmax does for -inf.
    tl.store(token_ids_ptr + row, tl.where(column == NO_COLUMN, 0, column))
    tl.store(values_ptr + row, value)


def gumbel_sample(logits: torch.Tensor, inv_temperatures: torch.Tensor, seed: int,
                  num_chunks: int | None = None) -> torch.Tensor:
    """One token id per row ([B] int64) of `logits` ([B, V], float16/bfloat16/float32; never
    modified): a draw from softmax(logits * inv_temperatures[row]) where inv_temperatures ([B]
    float32, on the same device) is positive, and the argmax (lowest id on ties) where it is 0.

    The draw is a function of (seed, row, column) and the logits alone; seed is a non-negative
    integer below 2^64. num_chunks overrides how many programs share a row (tests use it); by
    default there are about TARGET_WAVES programs per multiprocessor.
    """
    return gumbel_best(logits, inv_temperatures, seed, 0, logits.shape[-1] if logits.dim() else 0, num_chunks)[1]


def gumbel_best(logits: torch.Tensor, inv_temperatures: torch.Tensor, seed: int, column_offset: int,
                vocab_size: int, num_chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gumbel_sample over a slice of the vocabulary: `logits` [B, n] are columns [column_offset,
    column_offset + n) of a vocabulary of vocab_size. Returns each row's best score ([B] float32, in
    the kernel's log2 units; -inf for a row with no finite score) and its token id ([B] int64, of
    the whole vocabulary). Every column's noise is the one gumbel_sample gives it over the whole
    vocabulary, so the best of the slices' bests (highest score, lowest id on ties) is
    gumbel_sample's token: tensor parallelism samples from each rank's slice of the logits."""
    _check_arguments(logits, inv_temperatures, seed, column_offset, vocab_size)
    num_rows, num_columns = logits.shape
    column_end = column_offset + num_columns
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    values = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return values, token_ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()  # a copy: the caller's tensor stays as it is
    inv_temperatures = inv_temperatures.contiguous()
    if num_chunks is None:
        num_chunks = default_num_chunks(num_rows, num_columns, logits.device)
    chunk_size, num_chunks = _chunk_layout(column_offset, column_end, num_chunks)
    partial_values = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    partial_columns = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    _gumbel_chunk_kernel[(num_rows, num_chunks)](
        logits, inv_temperatures, partial_values, partial_columns,
        column_offset, column_end, vocab_size, chunk_size, seed, logits.stride(0), num_chunks,
        BLOCK=BLOCK, FAST_LOG=logits.device.type == "cuda", num_warps=NUM_WARPS,
    )
    _reduce_chunks_kernel[(num_rows,)](
        partial_values, partial_columns, token_ids, values, num_chunks,
        BLOCK_CHUNKS=REDUCE_BLOCK, num_warps=1,
    )
    return values, token_ids


def _check_arguments(logits: torch.Tensor, inv_temperatures: torch.Tensor, seed: int, column_offset: int,
                     vocab_size: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    num_rows, num_columns = logits.shape
    if logits.dtype not in FUSED_SAMPLING_DTYPES:
        raise ValueError(f"logits must be one of {FUSED_SAMPLING_DTYPES}, got {logits.dtype}")
    if num_columns == 0:
        raise ValueError("logits have an empty vocabulary")
    column_end = column_offset + num_columns
    if not 0 <= column_offset < column_end <= vocab_size:
        raise ValueError(f"columns [{column_offset}, {column_end}) outside a vocabulary of {vocab_size}")
    if tuple(inv_temperatures.shape) != (num_rows,) or inv_temperatures.dtype != torch.float32:
        raise ValueError(f"inv_temperatures must be [{num_rows}] float32, got {tuple(inv_temperatures.shape)} "
                         f"{inv_temperatures.dtype}")
    if inv_temperatures.device != logits.device:
        raise ValueError(f"inv_temperatures on {inv_temperatures.device}, logits on {logits.device}")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must fit in 64 unsigned bits, got {seed}")


def default_num_chunks(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Chunks per row so that the grid has about TARGET_WAVES programs per multiprocessor."""
    num_programs = TARGET_WAVES * num_sms(device, INTERPRETER_NUM_SMS)
    return max(1, min(triton.cdiv(num_programs, num_rows), triton.cdiv(vocab_size, BLOCK)))


def _chunk_layout(column_offset: int, column_end: int, num_chunks: int) -> tuple[int, int]:
    """(chunk_size, num_chunks) for about num_chunks chunks of whole tiles (tiles of the whole
    vocabulary) covering columns [column_offset, column_end), none of them empty."""
    num_tiles = triton.cdiv(column_end, BLOCK) - column_offset // BLOCK
    chunk_size = triton.cdiv(num_tiles, max(1, min(num_chunks, num_tiles))) * BLOCK
    return chunk_size, triton.cdiv(num_tiles * BLOCK, chunk_size)

