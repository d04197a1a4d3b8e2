"""A link whose bandwidth concurrent transfers share equally (processor sharing), so two
restores from the same NVMe drive each take twice as long as one alone.

A transfer is given as its work in bytes; the caller adds `latency x bandwidth` bytes per
operation, so a single transfer of chunks of n bytes takes exactly the cost model's
sum of `latency + n / bandwidth`. Under sharing, the latency share is slowed down like the
bytes are, which overstates it where a real device overlaps many operations' latencies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from kvtier.sim.events import EventLoop

_DONE_S = 1e-12  # work left that takes less than this is done (float rounding)


class Channel:
    def __init__(self, loop: EventLoop, bandwidth: float) -> None:
        self.loop = loop
        self.bandwidth = bandwidth
        self._jobs: dict[int, list[Any]] = {}  # id -> [work left, callback, args]
        self._ids = itertools.count()
        self._updated = 0.0
        self._version = 0
        self.bytes_moved = 0.0

    @property
    def active(self) -> int:
        return len(self._jobs)

    def submit(self, work_bytes: float, callback: Callable[..., None], *args: Any) -> None:
        """Move `work_bytes`, then call `callback(*args)`."""
        self._advance()
        self._jobs[next(self._ids)] = [work_bytes, callback, args]
        self.bytes_moved += work_bytes
        self._reschedule()

    def _advance(self) -> None:
        now = self.loop.now
        if self._jobs:
            share = (now - self._updated) * self.bandwidth / len(self._jobs)
            for job in self._jobs.values():
                job[0] -= share
        self._updated = now

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            least = min(job[0] for job in self._jobs.values())
            finish = self.loop.now + max(least, 0.0) * len(self._jobs) / self.bandwidth
            self.loop.at(finish, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return  # the job set changed since this completion was planned
        self._advance()
        threshold = max(_DONE_S * self.bandwidth, min(job[0] for job in self._jobs.values()))
        done = [key for key, job in self._jobs.items() if job[0] <= threshold]
        finished = [self._jobs.pop(key) for key in done]
        self._reschedule()
        for _, callback, args in finished:
            callback(*args)
