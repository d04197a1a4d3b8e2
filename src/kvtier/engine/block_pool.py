"""What blocks exist: free ids, refcounts, the prefix cache (key -> block) and its LRU.

A block is in exactly one of four states:
- free: no owner, no key (`free_block_ids`);
- in use: refcount > 0 (owned by one or more requests; a cached block can be shared);
- cached and idle: refcount 0 but its key still maps to it (`evictable`, oldest first);
- kept: cached and idle, and its content has been moved to a lower tier by a policy
  (`kept`): free as far as the policy is concerned, still hittable.
Allocation takes free blocks, then kept ones, then the LRU's idle cached blocks, each least
recently freed first, so a finished conversation's KV stays hittable for as long as memory
allows, and a moved one for as long as nothing else needs its pages.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvtier.engine.hooks import FULL_FORM, BlockEventListener
from kvtier.oldest_first import OldestFirst


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached_block_ids: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # kept blocks, handed back least recently freed first (a request's blocks go idle
        # tail first, so a conversation's head is reused last)
        self.kept: OldestFirst[int] = OldestFirst()
        self.num_kept_hits = 0  # kept blocks a prefix hit took back
        self._idle_at = [0] * num_blocks  # when each block last went idle (a counter)
        self._idle_clock = 0
        # Stored form of each block's contents ("full" when computed here; a codec's form
        # when restored from a lossy copy), so a lossy block is never mistaken for exact.
        self.forms = [FULL_FORM] * num_blocks
        self.listeners: list[BlockEventListener] = []
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with no owner and no key (not counting evictable cached ones)."""
        return len(self.free_block_ids)

    @property
    def num_allocatable(self) -> int:
        return len(self.free_block_ids) + len(self.kept) + len(self.evictable)

    @property
    def num_kept(self) -> int:
        """Idle cached blocks whose content a policy moved to a lower tier."""
        return len(self.kept)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_allocatable

    @property
    def num_cached_idle(self) -> int:
        return len(self.evictable) + len(self.kept)

    def add_listener(self, listener: BlockEventListener) -> None:
        self.listeners.append(listener)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks, evicting idle cached blocks (oldest first) when free ones run out.

        The caller checks `num_allocatable` first; asking for more is a bookkeeping bug.
        """
        if n > self.num_allocatable:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_allocatable} allocatable")
        block_ids = []
        for _ in range(n):
            if self.free_block_ids:
                block_id = self.free_block_ids.popleft()
            elif self.kept:
                block_id = self.kept.pop_oldest()
                self._evict(block_id)
            else:
                block_id, _ = self.evictable.popitem(last=False)
                self._evict(block_id)
            self.ref_counts[block_id] = 1
            self.forms[block_id] = FULL_FORM  # its new owner computes it from scratch
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Add a reference to cached blocks a request reuses (prefix hit)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                if self.kept.discard(block_id):
                    self.num_kept_hits += 1
                else:
                    del self.evictable[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; idle ones go to the LRU or the free queue.

        Callers pass a request's blocks tail first, so within one request the tail of the
        sequence is evicted before its head (heads are the prefixes other requests share).
        """
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] > 0:
                continue
            if self.block_keys[block_id] is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable[block_id] = None
                self._idle_clock += 1
                self._idle_at[block_id] = self._idle_clock
                for listener in self.listeners:
                    listener.on_block_freed(block_id)

    def cache_block(self, block_id: int, key: bytes) -> bool:
        """Register a full, computed block under its key; False if the key is already cached.

        Two requests can compute the same content at once; the first block registered keeps
        the key and the duplicate simply returns to the free queue when released.
        """
        if not self.enable_caching or key in self.cached_block_ids:
            return False
        self.cached_block_ids[key] = block_id
        self.block_keys[block_id] = key
        for listener in self.listeners:
            listener.on_block_filled(block_id, key)
        return True

    def lookup(self, key: bytes) -> int | None:
        return self.cached_block_ids.get(key)

    def resident(self, key: bytes) -> int | None:
        """The block holding `key`, unless it is kept (its content already moved down)."""
        block_id = self.cached_block_ids.get(key)
        return None if block_id is None or block_id in self.kept else block_id

    def is_cached(self, block_id: int) -> bool:
        """The block holds computed KV under a key (in use or idle): a prefix can hit it."""
        return self.block_keys[block_id] is not None

    def is_idle_cached(self, block_id: int) -> bool:
        """Cached and held by nobody: the LRU may evict it (a prefix hit takes it back)."""
        return self.ref_counts[block_id] == 0 and (
            block_id in self.evictable or block_id in self.kept
        )

    def set_form(self, block_id: int, form: str) -> None:
        self.forms[block_id] = form

    def reset_prefix_cache(self) -> int:
        """Forget every idle cached block (they become free); returns how many."""
        dropped = [*self.kept, *self.evictable]
        self.kept.clear()
        self.evictable.clear()
        for block_id in dropped:
            self._evict(block_id)
            self.free_block_ids.append(block_id)
        return len(dropped)

    def drop_cached(self, block_ids: list[int]) -> int:
        """Evict these idle cached blocks now (a policy moved or dropped them); returns how
        many were dropped. Blocks in use or not cached are left alone."""
        dropped = 0
        for block_id in block_ids:
            if self.ref_counts[block_id]:
                continue  # in use
            if block_id in self.evictable:
                del self.evictable[block_id]
            elif not self.kept.discard(block_id):
                continue  # free: nothing cached to drop
            self._evict(block_id)
            self.free_block_ids.append(block_id)
            dropped += 1
        return dropped

    def keep(self, block_ids: list[int]) -> int:
        """These idle cached blocks' content was moved to a lower tier (a policy decided):
        reuse them before the LRU's (least recently freed first among them), while a prefix
        hit can still take them back. Returns how many were kept; blocks in use or not cached
        are left alone."""
        kept = 0
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0 and block_id in self.evictable:
                del self.evictable[block_id]
                self.kept.add(block_id, self._idle_at[block_id])
                kept += 1
        return kept

    def _evict(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        assert key is not None, "only cached blocks are evictable"
        for listener in self.listeners:
            listener.on_block_evicted(block_id, key)
        del self.cached_block_ids[key]
        self.block_keys[block_id] = None
        self.num_evictions += 1
