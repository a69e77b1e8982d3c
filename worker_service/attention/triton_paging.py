"""Triton device helpers shared by the paged attention kernels: from a block table to the addresses
of one tile of BLOCK_N context tokens.

The kernels load the page ids of tile i+1 while they work on tile i (a loop-carried value). When the
K/V addresses of a tile instead depend on a load made in the same iteration, Triton's software
pipeliner keeps a single shared-memory buffer (seen in the sm_90 PTX of Triton 3.6: wait_group 0
and one stage of K/V), so nothing overlaps the next tile's loads within a program; carried across
iterations, it multi-buffers as num_stages asks.
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
