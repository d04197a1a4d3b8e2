"""BackgroundWrites: the connector's spills, demotes and deletes in flight on the mover.

The engine thread only stages a chunk's bytes (one gather copy out of the device pool) and
queues the write; the tier I/O, checksums, encryption and the store's cascade of demotions run
on the `Mover`'s worker. Until a write finishes, the engine must still see what it asked for:

- a chunk whose put is in flight is readable from its staged bytes (`staged`), so a request
  resumed right after a spill restores it without waiting for the tier;
- a chunk whose delete is in flight is gone (`deleting`), so it is neither restored nor
  counted as stored.

Results are accounted on the engine thread (`reap`, each step): the callbacks given with each
write update the connector's counters there, so no counter is touched by two threads.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.tiers import Chunk, Mover, Payload


class Staged(NamedTuple):
    """A put in flight: its bytes (full precision), target tier, and the form those bytes
    count as (not "full" when they were gathered from blocks restored from a lossy form)."""

    payload: Payload
    tier: str
    form: str


@dataclass(slots=True)
class _Staged:
    staged: Staged
    future: Future[bool]


class BackgroundWrites:
    def __init__(self, mover: Mover, top_tier: str) -> None:
        self.mover = mover
        self.top_tier = top_tier
        self._staged: dict[bytes, _Staged] = {}
        self._deleting: dict[bytes, Future[bool]] = {}
        self._done: list[tuple[Future[bool], Callable[[bool], None]]] = []

    def put(
        self,
        chunk: Chunk,
        payload: Payload,
        tier: str | None,
        on_done: Callable[[bool], None],
        form: str = "full",
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Store `payload` (a copy the caller will not touch again) in `tier` in the background,
        at most as precise as `form` (the tier's own form may be less precise still). `ready`
        waits until the payload's bytes are there (a device copy in flight); the mover's
        worker calls it before reading them."""
        self._deleting.pop(chunk.id, None)  # queued after the delete: it runs after it
        future = self.mover.spill(chunk, payload, tier=tier, form=form, ready=ready)
        self._staged[chunk.id] = _Staged(Staged(payload, tier or self.top_tier, form), future)
        self._done.append((future, on_done))

    def demote(
        self, chunk_id: bytes, to: str, on_done: Callable[[bool], None], form: str | None = None
    ) -> None:
        self._done.append((self.mover.demote(chunk_id, to, form), on_done))

    def delete(self, chunk_id: bytes) -> None:
        self._staged.pop(chunk_id, None)
        self._deleting[chunk_id] = self.mover.delete(chunk_id)

    def staged(self, chunk_id: bytes) -> Staged | None:
        """The bytes and target tier of a put still in flight (None once it has finished:
        then the store has the chunk, or it failed and the chunk is recomputed)."""
        entry = self._staged.get(chunk_id)
        if entry is None or entry.future.done():
            return None
        return entry.staged

    def deleting(self, chunk_id: bytes) -> bool:
        future = self._deleting.get(chunk_id)
        return future is not None and not future.done()

    @property
    def staging(self) -> bool:
        """Some put has staged bytes not yet accounted (possibly still in flight)."""
        return bool(self._staged)

    @property
    def in_flight(self) -> int:
        return sum(1 for future, _ in self._done if not future.done())

    def reap(self) -> None:
        """Account finished writes (on the caller's thread) and forget their staged bytes."""
        if not self._done:
            return
        pending = []
        for future, on_done in self._done:
            if future.done():
                on_done(not future.cancelled() and future.result())
            else:
                pending.append((future, on_done))
        self._done = pending
        for table in (self._staged, self._deleting):
            for chunk_id in [c for c, e in table.items() if _future(e).done()]:
                del table[chunk_id]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has finished (tests, benchmarks, shutdown)."""
        futures = [future for future, _ in self._done] + list(self._deleting.values())
        _, not_done = wait(futures, timeout)
        self.reap()
        return not not_done


def _future(entry: _Staged | Future[bool]) -> Future[bool]:
    return entry.future if isinstance(entry, _Staged) else entry
