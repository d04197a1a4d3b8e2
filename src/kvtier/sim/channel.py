"""A link whose bandwidth concurrent transfers share equally (processor sharing), so two
restores from the same NVMe drive each take twice as long as one alone.

A transfer is given as its work in bytes; the caller adds `latency x bandwidth` bytes per
operation, so a single transfer of chunks of n bytes takes exactly the cost model's
sum of `latency + n / bandwidth`. Under sharing, the latency share is slowed down like the
bytes are, which overstates it where a real device overlaps many operations' latencies.

A transfer may come in parts that land one after another (`submit_in_order`): the copies one
decision issues on one copy stream, which complete in issue order (a CUDA stream runs its
copies in order, and vLLM's offloading worker chains its transfers so they do too). Such a
transfer takes one share of the link, as one stream does, and reports each part as it lands.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.sim.events import EventLoop

_DONE_S = 1e-12  # work left that takes less than this is done (float rounding)


class _Transfer:
    """Parts of work moved one after another; `left` is what remains of part `landed`."""

    __slots__ = ("landed", "left", "on_part", "parts")

    def __init__(self, parts: Sequence[float], on_part: Callable[[int], None]) -> None:
        self.parts, self.on_part = parts, on_part
        self.landed = 0
        self.left = parts[0]


class Channel:
    def __init__(self, loop: EventLoop, bandwidth: float) -> None:
        self.loop = loop
        self.bandwidth = bandwidth
        self._jobs: dict[int, _Transfer] = {}
        self._ids = itertools.count()
        self._updated = 0.0
        self._version = 0
        self.bytes_moved = 0.0

    @property
    def active(self) -> int:
        return len(self._jobs)

    def submit(self, work_bytes: float, callback: Callable[..., None], *args: Any) -> None:
        """Move `work_bytes`, then call `callback(*args)`."""
        self.submit_in_order([work_bytes], lambda _: callback(*args))

    def submit_in_order(self, parts: Sequence[float], on_part: Callable[[int], None]) -> None:
        """Move `parts` (bytes of work each, at least one) one after another as one transfer,
        calling `on_part(i)` as part i lands."""
        self._advance()
        self._jobs[next(self._ids)] = _Transfer(parts, on_part)
        self.bytes_moved += sum(parts)
        self._reschedule()

    def _advance(self) -> None:
        now = self.loop.now
        if self._jobs:
            share = (now - self._updated) * self.bandwidth / len(self._jobs)
            for job in self._jobs.values():
                job.left -= share
        self._updated = now

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            least = min(job.left for job in self._jobs.values())
            finish = self.loop.now + max(least, 0.0) * len(self._jobs) / self.bandwidth
            self.loop.at(finish, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return  # the job set changed since this completion was planned
        self._advance()
        jobs = self._jobs
        threshold = max(_DONE_S * self.bandwidth, min(job.left for job in jobs.values()))
        landed = []
        for key in [key for key, job in jobs.items() if job.left <= threshold]:
            job = jobs[key]
            landed.append((job.on_part, job.landed))
            job.landed += 1
            if job.landed == len(job.parts):
                del jobs[key]
            else:  # the next part starts now, with the stream's share of the link
                job.left = job.parts[job.landed]
        self._reschedule()
        for on_part, part in landed:
            on_part(part)
