"""The discrete-event loop: a heap of (time, sequence number, callback). Ties in time run in
the order they were scheduled, so a run is a pure function of its inputs."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.processed = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def at(self, t: float, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` at time `t` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), callback, args))

    def next_time(self) -> float:
        """When the next scheduled event happens; inf when none is."""
        return self._heap[0][0] if self._heap else math.inf

    def run(self) -> None:
        heap = self._heap
        while heap:
            t, _, callback, args = heapq.heappop(heap)
            self.now = t
            self.processed += 1
            callback(*args)
