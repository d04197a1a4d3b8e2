"""OldestFirst: a set of keys handed back in the order of a value given with each, lowest
first, where keys leave and come back out of that order.

Kept device blocks and kept simulated pages are kept in batches by policy decisions, not in
the order they went idle, and a prefix hit or a drop takes one out at any time: a heap of
(order, entry number, key) whose entries for keys that left, or were added again since, are
skipped when they surface. Two keys with the same order come out in the order they were
added. Used by the engine's block pool (`BlockPool.keep`) and the simulator's replica
(`--keep-moved`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class OldestFirst(Generic[K]):
    def __init__(self) -> None:
        self._entry: dict[K, int] = {}  # key -> its live heap entry's number
        self._heap: list[tuple[Any, int, K]] = []  # (order, entry number, key), stale ones too
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry

    def __iter__(self) -> Iterator[K]:
        return iter(self._entry)

    def add(self, key: K, order: Any) -> None:
        """Add `key` (or move it) to where `order` puts it."""
        number = next(self._numbers)
        self._entry[key] = number
        heapq.heappush(self._heap, (order, number, key))
        if len(self._heap) > 2 * len(self._entry) + 1024:  # mostly stale: drop those
            live = self._entry
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def discard(self, key: K) -> bool:
        """Take `key` out; False if it was not in."""
        return self._entry.pop(key, None) is not None

    def pop_oldest(self) -> K:
        """Take out the key of the lowest order (there must be one)."""
        while True:
            _, number, key = heapq.heappop(self._heap)
            if self._entry.get(key) == number:
                del self._entry[key]
                return key

    def clear(self) -> None:
        self._entry.clear()
        self._heap.clear()
