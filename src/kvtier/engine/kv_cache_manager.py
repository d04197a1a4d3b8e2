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
        # The request whose blocks are entering the prefix cache right now, and those
        # blocks: a block listener learns who filled a block however many of them one step
        # registers (a restore of thousands of tokens included).
        self.filling: tuple[str, frozenset[int]] | None = None
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

    def find_cached_prefix(self, request: Request, start_block: int = 0) -> list[int]:
        """Blocks of the request's longest cached run of full blocks from `start_block` (0:
        its cached prefix; later, where a recomputed run ends and its history goes on).

        The last token is never taken from the cache: the step must compute at least one
        position to produce the logits of the next token.
        """
        if not self.block_pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        keys = request.keys_of_full_blocks(self.block_size)[start_block:max_blocks]
        hits = []
        for key in keys:
            block_id = self.block_pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: Sequence[int] = (),
        num_loaded_tokens: int = 0,
    ) -> bool:
        """Give the request room for `num_loaded_tokens` a connector will load, then
        `num_new_tokens` to compute, after its table and the `cached` blocks appended to it.

        `cached` and loaded tokens come only where the request's slots end on a block
        boundary with no block allocated past them (admission, or a prefill stopped where
        its stored history resumes). The loaded tokens' blocks are the first fresh ones
        (`loaded_blocks`); like computed blocks they enter the prefix cache once a step has
        counted them as computed (`register_full_blocks`).
        Returns False, changing nothing, when free plus evictable blocks do not suffice.
        Reused idle cached blocks stop being evictable, so they count against the free room.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        slots = self.num_slots(request)
        if (cached or num_loaded_tokens) and slots != len(table) * self.block_size:
            raise ValueError("cached or loaded blocks must start on the table's block boundary")
        num_tokens = slots + len(cached) * self.block_size + num_loaded_tokens + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(cached)
        num_idle_reused = sum(1 for b in cached if self.block_pool.ref_counts[b] == 0)
        if num_new_blocks + num_idle_reused > self.block_pool.num_allocatable:
            if not table:
                del self.block_tables[request.request_id]
            return False
        if cached:
            self.register_full_blocks(request)  # the blocks before these, if not done yet
            registered = self._num_registered.get(request.request_id, 0) == len(table)
            self.block_pool.touch(list(cached))
            table.extend(cached)
            if registered:  # cached blocks are in the prefix cache already
                self._num_registered[request.request_id] = len(table)
        if num_new_blocks > 0:
            table.extend(self.block_pool.allocate(num_new_blocks))
        return True

    def loaded_blocks(self, request: Request, num_loaded_tokens: int) -> list[int]:
        """The blocks `allocate` gave the loaded tokens: those right after the request's
        computed slots (call before advancing `num_computed_tokens` over them)."""
        first = self.num_slots(request) // self.block_size
        table = self.block_tables.get(request.request_id, [])
        return table[first : first + num_loaded_tokens // self.block_size]

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
        self.filling = (request.request_id, frozenset(table[start:num_full]))
        try:
            for i in range(start, num_full):
                self.block_pool.cache_block(table[i], keys[i])
        finally:
            self.filling = None
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
