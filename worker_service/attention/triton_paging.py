"""Triton device helpers shared by the paged attention kernels: from a block table to the addresses
of one tile of BLOCK_N context tokens.

The kernels load the page ids of tile i+1 while they work on tile i (a loop-carried value). When the
K/V addresses of a tile instead depend on a load made in the same iteration, Triton's software
pipeliner keeps a single shared-memory buffer (seen in the sm_90 PTX of Triton 3.6: wait_group 0
and one stage of K/V), so nothing overlaps the next tile's loads within a program; carried across
iterations, it multi-buffers as num_stages asks.

prefetch_to_l2 lets a kernel launched with PDL (layers/triton_pdl) start a tile's reads before it
waits for the previous kernel: an L2 prefetch returns no value and L2 is where every multiprocessor's
writes meet, so a line the previous kernel writes afterwards is read new by the loads after the wait.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_page_ids(table, tile_start, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of the tile of tokens tile_start..tile_start+BLOCK_N-1 (0 at and past end): one
    scalar when a tile lies within one page (tiles are BLOCK_N-aligned and BLOCK_N divides the
    page size), else one per token."""
    if BLOCK_N <= BLOCK_SIZE:
        page_ids = tl.load(table + tile_start // BLOCK_SIZE, mask=tile_start < end, other=0)
    else:
        positions = tile_start + tl.arange(0, BLOCK_N)
        page_ids = tl.load(table + positions // BLOCK_SIZE, mask=positions < end, other=0)
    return page_ids


@triton.jit
def token_offsets(page_ids, tile_start, stride_block, stride_token, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Element offsets [BLOCK_N] (int64: a layer's cache can exceed 2**31 elements) of the tile's
    tokens in a cache [num_blocks, BLOCK_SIZE, ...] with the given strides."""
    cols = tl.arange(0, BLOCK_N)
    if BLOCK_N <= BLOCK_SIZE:
        offsets = page_ids.to(tl.int64) * stride_block + (tile_start % BLOCK_SIZE + cols) * stride_token
    else:
        offsets = page_ids.to(tl.int64) * stride_block + ((tile_start + cols) % BLOCK_SIZE) * stride_token
    return offsets


L2_LINE_BYTES = 128


@triton.jit
def prefetch_to_l2(rows, ROW_ELEMENTS: tl.constexpr, LINE_ELEMENTS: tl.constexpr, ROW_LINES: tl.constexpr):
    """Asks L2 to fetch the lines of rows of ROW_ELEMENTS elements (rows: a tensor of row starts that lie
    inside an allocation, masked rows too; row_lines gives the other two constants). No value comes back
    and no register waits: the program goes on at once (CUDA only: inline PTX)."""
    starts = tl.minimum(tl.arange(0, ROW_LINES) * LINE_ELEMENTS, ROW_ELEMENTS - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [rows[:, None] + starts[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


def row_lines(row_elements: int, element_size: int) -> tuple[int, int]:
    """(LINE_ELEMENTS, ROW_LINES) of prefetch_to_l2 for rows of row_elements elements of element_size bytes."""
    line_elements = max(1, L2_LINE_BYTES // element_size)
    return line_elements, triton.next_power_of_2(triton.cdiv(row_elements, line_elements))
