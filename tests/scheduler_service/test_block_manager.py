"""Block manager: exact block ids, reference counts, prefix-cache hits, revival and eviction order."""
from __future__ import annotations

import pytest

from common.contract.sampling_params import SamplingParams
from scheduler_service.core.block_manager import NO_PARENT_HASH, BlockManager, StoredBlock, chain_hash
from scheduler_service.core.sequence import Sequence

BLOCK = 16


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def admit_all(manager: BlockManager, seq: Sequence) -> bool:
    """Admits seq as the scheduler does, with every uncached token to compute in one step, and
    registers the computed blocks."""
    hit = manager.find_prefix_hit(seq)
    num_cached = len(hit.blocks) * manager.block_size
    if not manager.admit(seq, hit, seq.num_tokens - num_cached):
        return False
    seq.admit(num_cached)
    seq.schedule(seq.num_tokens - num_cached)
    manager.register_computed_blocks(seq)
    return True


def test_allocation_takes_lowest_free_ids_in_order() -> None:
    manager = BlockManager(8, BLOCK)
    seq = seq_of(list(range(40)))  # 3 blocks
    assert admit_all(manager, seq)
    assert seq.block_table == [0, 1, 2]
    assert [manager.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert manager.num_free_blocks == 5


def test_full_blocks_are_hashed_chained_and_partial_block_is_not() -> None:
    manager = BlockManager(8, BLOCK)
    tokens = list(range(40))
    seq = seq_of(tokens)
    admit_all(manager, seq)
    first = chain_hash(0, tokens[:16])
    second = chain_hash(first, tokens[16:32])
    assert seq.block_hashes == [first, second]
    assert manager.hash_to_block_id == {first: 0, second: 1}
    assert manager.blocks[2].hash is None
    # Same tokens behind a different prefix hash differently.
    assert chain_hash(0, tokens[16:32]) != second


def test_shared_prefix_hits_increment_ref_counts() -> None:
    manager = BlockManager(8, BLOCK)
    prefix = list(range(32))
    a = seq_of(prefix + [100, 101])
    b = seq_of(prefix + [200, 201, 202])
    admit_all(manager, a)
    hit = manager.find_prefix_hit(b)
    assert [block.block_id for block in hit.blocks] == [0, 1]
    assert hit.num_in_use == 2
    assert admit_all(manager, b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 32
    assert [manager.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert manager.num_prefix_hit_tokens == 32


def test_whole_prompt_cached_still_leaves_one_token_to_compute() -> None:
    manager = BlockManager(8, BLOCK)
    tokens = list(range(32))
    admit_all(manager, seq_of(tokens))
    again = seq_of(tokens)
    hit = manager.find_prefix_hit(again)
    assert [block.block_id for block in hit.blocks] == [0]  # the last block is recomputed


def test_hash_collision_is_rejected_by_token_comparison() -> None:
    manager = BlockManager(8, BLOCK)
    admit_all(manager, seq_of(list(range(20))))
    block = manager.blocks[0]
    block.token_ids = tuple(range(1, 17))  # as if another block's tokens hashed alike
    assert manager.find_prefix_hit(seq_of(list(range(20)))).blocks == ()


def test_freed_blocks_keep_hash_and_are_revived() -> None:
    manager = BlockManager(8, BLOCK)
    tokens = list(range(40))
    a = seq_of(tokens)
    admit_all(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 8
    assert a.block_table == []
    b = seq_of(tokens[:32] + [7, 7])
    hit = manager.find_prefix_hit(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]
    assert hit.num_in_use == 0
    assert admit_all(manager, b)
    assert b.block_table[:2] == [0, 1]
    assert manager.blocks[0].ref_count == 1


def test_free_order_is_tail_first_and_reuse_is_least_recently_freed_first() -> None:
    manager = BlockManager(6, BLOCK)
    a = seq_of(list(range(48)))  # blocks 0, 1, 2
    admit_all(manager, a)
    manager.free(a)
    # Never-used blocks 3, 4, 5 come first, then a's blocks tail first: 2, 1, 0.
    assert list(manager.free_block_ids) == [3, 4, 5, 2, 1, 0]
    c = seq_of([9] * 80)  # 5 blocks, none cached
    assert admit_all(manager, c)
    assert c.block_table == [3, 4, 5, 2, 1]
    # Reusing blocks 2 and 1 evicted a's second and third blocks; block 0 still holds its first.
    assert manager.blocks[2].token_ids == tuple([9] * 16)
    first = chain_hash(0, list(range(16)))
    second = chain_hash(first, list(range(16, 32)))
    assert manager.hash_to_block_id[first] == 0
    assert second not in manager.hash_to_block_id
    hit = manager.find_prefix_hit(seq_of(list(range(48))))
    assert [block.block_id for block in hit.blocks] == [0]


def test_admission_fails_without_change_when_pool_is_short() -> None:
    manager = BlockManager(4, BLOCK)
    a = seq_of(list(range(40)))
    admit_all(manager, a)
    b = seq_of([5] * 40)
    hit = manager.find_prefix_hit(b)
    assert not manager.admit(b, hit, 40)
    assert b.block_table == []
    assert manager.num_free_blocks == 1


def test_admission_counts_in_use_hits_as_free() -> None:
    manager = BlockManager(4, BLOCK)
    prefix = list(range(32))
    a = seq_of(prefix + [1])
    admit_all(manager, a)  # 3 blocks used, 1 free
    b = seq_of(prefix + [2])
    assert admit_all(manager, b)  # shares 2 blocks, needs just 1 more
    assert b.block_table == [0, 1, 3]


def test_allocate_slots_grows_table_for_decode() -> None:
    manager = BlockManager(4, BLOCK)
    seq = seq_of(list(range(16)))
    admit_all(manager, seq)
    assert seq.block_table == [0]
    assert manager.allocate_slots(seq, 17)
    assert seq.block_table == [0, 1]
    assert manager.allocate_slots(seq, 32)
    assert seq.block_table == [0, 1]
    assert not manager.allocate_slots(seq, 100)
    assert seq.block_table == [0, 1]


def test_duplicate_content_registers_once() -> None:
    manager = BlockManager(8, BLOCK)
    tokens = list(range(20))
    a, b = seq_of(tokens), seq_of(tokens)
    # Both admitted before either registers: b computes its own copy of the block.
    hit_a, hit_b = manager.find_prefix_hit(a), manager.find_prefix_hit(b)
    manager.admit(a, hit_a, 20)
    manager.admit(b, hit_b, 20)
    for seq in (a, b):
        seq.num_computed_tokens = 20
        manager.register_computed_blocks(seq)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert manager.hash_to_block_id == {chain_hash(0, tokens[:16]): 0}
    assert manager.blocks[2].hash is None


@pytest.mark.parametrize("bad", [0, 3, 24])
def test_block_size_must_be_power_of_two(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, bad)


def test_reset_prefix_cache_forgets_every_hash() -> None:
    manager = BlockManager(8, BLOCK)
    tokens = list(range(40))
    a = seq_of(tokens)
    admit_all(manager, a)
    manager.free(a)
    manager.reset_prefix_cache()
    assert manager.hash_to_block_id == {}
    assert manager.find_prefix_hit(seq_of(tokens)).blocks == ()


class RecordingListener:
    """A BlockListener that keeps what it hears, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def blocks_stored(self, blocks: list[StoredBlock]) -> None:
        self.events.append(("stored", [(b.parent_hash, b.block_hash, b.token_ids) for b in blocks]))

    def blocks_removed(self, hashes: list[int]) -> None:
        self.events.append(("removed", hashes))

    def cache_cleared(self) -> None:
        self.events.append(("cleared",))


def test_the_listener_hears_blocks_stored_evicted_and_cleared() -> None:
    listener = RecordingListener()
    manager = BlockManager(2, BLOCK, listener=listener)
    first = seq_of(list(range(2 * BLOCK)))
    assert admit_all(manager, first)  # both blocks full: stored, chained
    h0 = chain_hash(NO_PARENT_HASH, list(range(BLOCK)))
    h1 = chain_hash(h0, list(range(BLOCK, 2 * BLOCK)))
    assert listener.events == [("stored", [(NO_PARENT_HASH, h0, tuple(range(BLOCK))),
                                           (h0, h1, tuple(range(BLOCK, 2 * BLOCK)))])]
    manager.free(first)
    again = seq_of(list(range(BLOCK)) + [999] * 3)  # revives block 0 (no event), evicts the other cached block
    assert admit_all(manager, again)
    assert listener.events[1:] == [("removed", [h1])]
    manager.reset_prefix_cache()
    assert listener.events[-1] == ("cleared",)
