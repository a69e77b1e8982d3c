"""The paged KV cache's block pool with prefix caching.

Every full block whose K/V have been computed is keyed by a chained xxhash of its tokens and of
its prefix's hash. A later sequence with the same prefix reuses those blocks (a hit is confirmed by
comparing tokens). Freed blocks keep their hash and can be revived until the allocator reuses them,
least recently freed first. Every operation costs O(blocks touched), never O(pool). A sequence's
block table and block hashes change only here, one method per change: admit, allocate_slots,
register_computed_blocks, free.

An optional listener (BlockListener) hears the prefix cache change: blocks registered, blocks
evicted, everything forgotten; the manager knows nothing of who listens (a gateway routing by
prefix, through the public API's KV event stream).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from scheduler_service.core.sequence import Sequence

NO_PARENT_HASH = 0


def chain_hash(parent_hash: int, token_ids: list[int]) -> int:
    """Hash of a full block given its prefix's hash: equal prefixes and tokens give equal hashes."""
    hasher = xxhash.xxh64()
    hasher.update(parent_hash.to_bytes(8, "little"))
    hasher.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return hasher.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefixHit:
    """Blocks of a sequence's prefix found in the cache, not yet taken."""

    blocks: tuple[Block, ...]
    hashes: tuple[int, ...]
    num_in_use: int  # how many of them other sequences hold (they cost no free block)


NO_PREFIX_HIT = PrefixHit((), (), 0)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block newly registered in the prefix cache, as a listener hears of it."""

    parent_hash: int  # the previous block's hash; NO_PARENT_HASH for a sequence's first block
    block_hash: int
    token_ids: tuple[int, ...]


class BlockListener(Protocol):
    """Hears the prefix cache change; called synchronously inside the manager's methods, so it must
    be cheap (append and return)."""

    def blocks_stored(self, blocks: list[StoredBlock]) -> None:
        """Full blocks of one sequence, in order, now found by lookups."""

    def blocks_removed(self, hashes: list[int]) -> None:
        """Cached blocks evicted for reuse: lookups no longer find them."""

    def cache_cleared(self) -> None:
        """Every cached block forgotten."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 listener: BlockListener | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is the order blocks were freed: the front is reused first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0  # counters, for tests and metrics
        self.num_prefix_query_tokens = 0
        self.listener = listener

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # Prefix cache lookups.

    def find_prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The cached blocks of seq's leading full blocks. At least one token is always left to
        compute, so that the step produces logits for the next token."""
        if not self.enable_prefix_caching:
            return NO_PREFIX_HIT
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        hashes: list[int] = []
        parent = NO_PARENT_HASH
        for index in range(max_blocks):
            tokens = seq.token_ids[index * self.block_size:(index + 1) * self.block_size]
            block_hash = chain_hash(parent, tokens)
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            blocks.append(self.blocks[block_id])
            hashes.append(block_hash)
            parent = block_hash
        num_in_use = sum(1 for block in blocks if block.ref_count > 0)
        return PrefixHit(tuple(blocks), tuple(hashes), num_in_use)

    # Allocation.

    def admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Gives a waiting sequence its prefix hit and blocks for num_new_tokens more tokens; False
        (and no change) if the pool lacks blocks. Hit blocks other sequences hold cost no free block.
        The caller then admits seq itself (Sequence.admit), with the hit's tokens as computed."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        num_cached_tokens = len(hit.blocks) * self.block_size
        if self.num_blocks_for(num_cached_tokens + num_new_tokens) - hit.num_in_use > self.num_free_blocks:
            return False
        for block in hit.blocks:
            if block.ref_count == 0:
                del self.free_block_ids[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        seq.block_hashes.extend(hit.hashes)
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += num_cached_tokens
        return self.allocate_slots(seq, num_cached_tokens + num_new_tokens)

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows seq's block table to hold num_tokens tokens; False (and no change) if the pool
        lacks blocks."""
        if num_tokens <= len(seq.block_table) * self.block_size:
            return True  # the common case, once per sequence per step: room in its last block
        num_missing = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if num_missing > self.num_free_blocks:
            return False
        for _ in range(num_missing):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # The block is reused: its cached content is gone.
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
                if self.listener is not None:
                    self.listener.blocks_removed([block.hash])
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (benchmarks: each run starts cold). Blocks in use keep
        their content but are no longer found by later lookups."""
        for block in self.blocks:
            block.hash = None
            block.token_ids = ()
        self.hash_to_block_id.clear()
        if self.listener is not None:
            self.listener.cache_cleared()

    # Registration and release.

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Registers every full block of seq whose K/V are now computed in the prefix cache."""
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= len(seq.block_hashes) or not self.enable_prefix_caching:
            return  # the common case, once per sequence per step: no block filled up
        stored: list[StoredBlock] = []
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else NO_PARENT_HASH
            tokens = seq.token_ids[index * self.block_size:(index + 1) * self.block_size]
            block_hash = chain_hash(parent, tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block.hash is None and block_hash not in self.hash_to_block_id:
                block.hash = block_hash
                block.token_ids = tuple(tokens)
                self.hash_to_block_id[block_hash] = block.block_id
                if self.listener is not None:
                    stored.append(StoredBlock(parent, block_hash, block.token_ids))
        if stored and self.listener is not None:
            self.listener.blocks_stored(stored)

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks; its tail is freed first so that shared prefixes outlive it."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
