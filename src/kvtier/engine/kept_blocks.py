"""KeptBlocks: the pool's kept blocks, handed back least recently used first.

A kept block is idle and cached, and a policy has moved its content to a lower tier
(`BlockPool.keep`). The pool reuses kept blocks before the LRU's other idle blocks, in the
order they went idle, as a prefix cache's LRU would (a request's blocks go idle tail first,
so a conversation's head is reused last). Blocks are kept in batches by policy decisions,
not in the order they went idle, so the order is a heap on the idle time; an entry whose
block has left (a prefix hit, a drop) or been kept again is skipped when it surfaces.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator


class KeptBlocks:
    def __init__(self) -> None:
        self._idle_at: dict[int, int] = {}  # block -> when it went idle (a pool counter)
        self._order: list[tuple[int, int]] = []  # heap of (idle at, block), stale ones too

    def __len__(self) -> int:
        return len(self._idle_at)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._idle_at

    def __iter__(self) -> Iterator[int]:
        return iter(self._idle_at)

    def add(self, block_id: int, idle_at: int) -> None:
        self._idle_at[block_id] = idle_at
        heapq.heappush(self._order, (idle_at, block_id))
        if len(self._order) > 2 * len(self._idle_at) + 64:  # mostly stale: rebuild
            self._order = [(t, b) for b, t in self._idle_at.items()]
            heapq.heapify(self._order)

    def discard(self, block_id: int) -> bool:
        """Forget `block_id`; False if it was not kept."""
        return self._idle_at.pop(block_id, None) is not None

    def pop_oldest(self) -> int:
        """The kept block that went idle first (there must be one)."""
        while True:
            idle_at, block_id = heapq.heappop(self._order)
            if self._idle_at.get(block_id) == idle_at:
                del self._idle_at[block_id]
                return block_id

    def clear(self) -> None:
        self._idle_at.clear()
        self._order.clear()
