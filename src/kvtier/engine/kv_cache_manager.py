"""Which request owns which blocks: block tables, prefix-cache lookup, allocation, release."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.block_tables: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        # Requests whose KV was compressed: token positions minus the KV slots they hold
        # (evicted tokens). Their blocks hold a subset of the prefix, so none is registered.
        self.num_evicted: dict[str, int] = {}
        # Prefix-cache counters, in tokens (what an operator graphs as hit rate).
        self.prefix_queries = 0
        self.prefix_hits = 0

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def num_slots(self, request: Request) -> int:
        """KV slots the request's computed tokens occupy (fewer than tokens once compressed)."""
        return request.num_computed_tokens - self.num_evicted.get(request.request_id, 0)

    def slot_of(self, request: Request, position: int) -> int:
        """Where the token at `position` goes: positions stay logical (RoPE), slots are
        compacted after evictions."""
        return position - self.num_evicted.get(request.request_id, 0)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks of the request's longest cached prefix (full blocks only).

        The last token is never taken from the cache: the step must compute at least one
        position to produce the logits of the next token.
        """
        if not self.block_pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        keys = request.keys_of_full_blocks(self.block_size)[:max_blocks]
        hits = []
        for key in keys:
            block_id = self.block_pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(self, request: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens after `cached` blocks.

        Returns False, changing nothing, when free plus evictable blocks do not suffice.
        Reused idle cached blocks stop being evictable, so they count against the free room.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        num_tokens = self.num_slots(request) + len(cached) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(cached)
        num_idle_reused = sum(1 for b in cached if self.block_pool.ref_counts[b] == 0)
        if num_new_blocks + num_idle_reused > self.block_pool.num_allocatable:
            if not table:
                del self.block_tables[request.request_id]
            return False
        if cached:
            self.block_pool.touch(list(cached))
            table.extend(cached)
            self._num_registered[request.request_id] = len(table)
        if num_new_blocks > 0:
            table.extend(self.block_pool.allocate(num_new_blocks))
        return True

    def append_computed(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Append blocks the caller filled (KV restored from a tier) after the request's
        computed tokens; the caller then advances `num_computed_tokens` over them. Only
        where the computed tokens end on a block boundary with no block allocated past it:
        False, changing nothing, otherwise."""
        table = self.block_tables.get(request.request_id)
        if table is None or request.request_id in self.num_evicted:
            return False
        if self.num_slots(request) != len(table) * self.block_size:
            return False
        self.register_full_blocks(request)  # the blocks before these, if not done yet
        table.extend(block_ids)
        if self._num_registered.get(request.request_id, 0) == len(table) - len(block_ids):
            self._num_registered[request.request_id] = len(table)  # the caller cached them
        return True

    def record_prefix_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_cached_tokens

    def register_full_blocks(self, request: Request) -> None:
        """Put blocks that became full and computed this step into the prefix cache."""
        if request.request_id in self.num_evicted:
            return  # compressed: its blocks do not hold the prefix their keys would name
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        keys = request.keys_of_full_blocks(self.block_size)
        table = self.block_tables[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_block(table[i], keys[i])
        self._num_registered[request.request_id] = num_full

    def replace_blocks(self, request: Request, num_slots: int) -> list[int]:
        """Swap the request's blocks for fresh private ones holding `num_slots` slots.

        Copy-on-compress: the old blocks may be shared with other requests or registered in
        the prefix cache (they still hold the full prefix), so they are released untouched
        (cached ones stay hittable until evicted) and never overwritten. The caller copies
        the kept KV out before and writes it into the returned table after. Releasing first
        means the new blocks always fit.
        """
        rid = request.request_id
        old = self.block_tables.pop(rid, [])
        self.block_pool.release(old[::-1])
        self._num_registered[rid] = 0
        self.num_evicted[rid] = request.num_computed_tokens - num_slots
        table = self.block_pool.allocate(cdiv(num_slots, self.block_size))
        self.block_tables[rid] = table
        return table

    def free(self, request: Request) -> None:
        """Release all of a request's blocks; its full blocks stay cached until evicted."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self.num_evicted.pop(request.request_id, None)
        self.block_pool.release(table[::-1])
