"""Bookkeeping invariants of the block pool and the KV cache manager, checked by tests."""

from __future__ import annotations

from collections import Counter

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.kv_cache_manager import KVCacheManager


def check_invariants(pool: BlockPool, manager: KVCacheManager) -> None:
    """Every block is in exactly one state and refcounts equal the owners that hold it."""
    owners = Counter(b for table in manager.block_tables.values() for b in table)
    free = list(pool.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free queue"
    free_set, idle_set, kept_set = set(free), set(pool.evictable), set(pool.kept)
    for block_id in range(pool.num_blocks):
        refs = pool.ref_counts[block_id]
        assert refs == owners[block_id], f"block {block_id}: refcount {refs} != {owners[block_id]}"
        states = (
            (block_id in free_set) + (block_id in idle_set) + (block_id in kept_set) + (refs > 0)
        )
        assert states == 1, f"block {block_id} is in {states} states"
        if block_id in free_set:
            assert pool.block_keys[block_id] is None
        if block_id in idle_set or block_id in kept_set:
            assert pool.block_keys[block_id] is not None
    # The prefix cache maps keys to blocks and back, one to one.
    for key, block_id in pool.cached_block_ids.items():
        assert pool.block_keys[block_id] == key
    assert sum(k is not None for k in pool.block_keys) == len(pool.cached_block_ids)
    # A block table never holds a block twice.
    for table in manager.block_tables.values():
        assert len(table) == len(set(table))
    in_use = sum(1 for r in pool.ref_counts if r > 0)
    assert in_use + len(free_set) + len(idle_set) + len(kept_set) == pool.num_blocks


def check_drained(pool: BlockPool, manager: KVCacheManager) -> None:
    """After every request ended: no owner, no reference, no leak."""
    check_invariants(pool, manager)
    assert not manager.block_tables
    assert all(r == 0 for r in pool.ref_counts)
    assert len(pool.free_block_ids) + len(pool.kept) + len(pool.evictable) == pool.num_blocks
