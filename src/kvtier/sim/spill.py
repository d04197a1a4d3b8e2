"""Spiller: a simulated replica's writes into its lower tiers, on each tier's write link, as
the engine's `kvtier.cache.spill` and `kvtier.cache.writes` issue them.

- `spill`: one policy decision's chunks copied off the device to one tier, in the order the
  decision moved them, as on one copy stream; each chunk's device memory frees when its own
  copy lands (and, with keep_moved, its pages are kept: `DevicePool.keep`).
- `write`: chunks copied between lower tiers, or a write-through copy, in the background:
  nothing waits for it.
- `write_through_chunks`: a finished turn's full chunks that have no copy yet are copied to
  the top tier, their device pages staying (`Chunks.copies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvtier.sim.chunks import Chunks
from kvtier.sim.links import Links
from kvtier.sim.pool import DevicePool
from kvtier.sim.session import SimSession
from kvtier.tiers.payload import Payload

# one chunk spilled off the device: (bytes written, device bytes freed, session, chunk)
Spill = tuple[int, int, SimSession, int]


class Spiller:
    def __init__(
        self,
        chunks: Chunks,
        pool: DevicePool,
        links: Links,
        write_through: bool,
        on_freed: Callable[[], None],
    ) -> None:
        self.chunks = chunks
        self.pool = pool
        self.links = links
        self.write_through = write_through
        self.on_freed = on_freed  # device memory just freed up: the queue may go on

    def write_through_chunks(self, session: SimSession) -> None:
        """Copy the full chunks that have no copy yet to the top tier, in one background
        write (the partial last chunk changes with the next turn, so it is not copied)."""
        chunks = self.chunks
        top = chunks.store.tiers[chunks.top_tier]
        written = []
        for i, size in enumerate(session.sizes):
            if session.copied[i] or size != chunks.full_chunk_bytes:
                continue
            chunks.reclaim(top, size)
            if not top.fits(size):
                break  # the tier is full of chunks the policies placed there
            chunks.store.put(session.chunk(i), Payload.sized(size), tier=chunks.top_tier)
            chunks.add_copy(session, i)
            written.append(size)
        if written:
            self.write(chunks.top_tier, written)

    def write(self, tier: str, sizes: Sequence[int]) -> None:
        """Copy chunks into a tier in the background: nothing waits for them."""
        link = self.links.paths[tier].write
        work = sum(sizes) + len(sizes) * link.latency_s * link.bandwidth
        self.links.in_flight += 1
        self.links.write[tier].submit(work, self._written)

    def _written(self) -> None:
        self.links.in_flight -= 1

    def spill(self, tier: str, spills: Sequence[Spill]) -> None:
        """Copy one decision's chunks off the device, `(bytes written, device bytes freed)`
        each, as an engine does: issued in order on one copy stream, they land in that order,
        and each chunk's device memory is free once its own copy has landed. So a request
        waiting under pressure starts once the first `bytes_needed` are out, while the rest
        of the spill (the headroom) still copies."""
        link = self.links.paths[tier].write
        per_op = link.latency_s * link.bandwidth
        self.links.in_flight += 1
        freed = [(size, session, index) for _, size, session, index in spills]
        self.links.write[tier].submit_in_order(
            [written + per_op for written, *_ in spills], partial(self._spilled, freed)
        )

    def _spilled(self, freed: Sequence[tuple[int, SimSession, int]], part: int) -> None:
        """Chunk `part` of a spill landed: the device frees what it took there, which is more
        than was written for a chunk stored in a smaller form."""
        if part == len(freed) - 1:
            self.links.in_flight -= 1
        size, session, index = freed[part]
        pool = self.pool
        pool.pending_free -= size
        pool.used -= size
        if index < len(session.tiers) and session.tiers[index] not in (None, "device"):
            pool.keep(session, index, size)
        pool.epoch += 1
        self.on_freed()
