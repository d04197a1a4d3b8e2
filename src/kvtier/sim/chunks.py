"""Chunks: where each chunk of a simulated replica's sessions is, below the device as on it,
as the engine's `kvtier.cache.chunks` is the one place restore, spill and the policy runner ask.

The tiers below the device are a size-only `TieredStore` (bytes counted, none kept). A session
(`SimSession`) says which tier each of its chunks is in; this class keeps that and the store
in step when a chunk is dropped, cut off by a shorter prompt, or found again in the pages the
device kept (`revive_kept`).

Write-through copies: a chunk on the device may also have a clean copy in the top tier
(`copies`, oldest first). Copies are dropped first when their tier needs the room
(`reclaim`): they only save a future transfer, so policies see the space they fill as free
(`copy_bytes` is left out of the top tier's use in their view).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from kvtier.sim.deployment import Deployment
from kvtier.sim.pool import DevicePool
from kvtier.sim.session import SimSession
from kvtier.tiers.sized import SizeOnlyTier
from kvtier.tiers.store import TieredStore
from kvtier.vocab import FULL


class Chunks:
    def __init__(self, deployment: Deployment, pool: DevicePool) -> None:
        self.deployment = deployment
        self.pool = pool
        tiers = [SizeOnlyTier(name, size) for name, size in deployment.tiers.items()]
        self.store = (
            TieredStore(
                tiers, block_tokens=deployment.block_size, chunk_tokens=deployment.chunk_tokens
            )
            if tiers
            else None
        )
        self.top_tier = next(iter(deployment.tiers), None)
        self.full_chunk_bytes = deployment.kv_bytes(deployment.chunk_tokens)
        # write-through copies, oldest first: (session id, chunk) -> session
        self.copies: dict[tuple[str, int], SimSession] = {}
        self.copy_bytes = 0
        self.dropped: Counter[str] = Counter()  # bytes dropped per lower tier

    # -- dropping and cutting ----------------------------------------------------------

    def drop(self, session: SimSession, i: int) -> None:
        """Free chunk `i` everywhere: a later turn recomputes it."""
        tier = session.tiers[i]
        if tier == "device":
            if session.copied[i]:
                self.uncopy(session, i)  # a drop frees the KV everywhere
            self.pool.used -= session.sizes[i]
            self.pool.epoch += 1
        elif tier is not None:
            self.pool.forget_kept(session.session_id, i)
            self.store.delete(session.chunk(i).id)
            self.dropped[tier] += session.sizes[i]
            session.sizes[i] = session.full.pop(i, session.sizes[i])
        session.tiers[i], session.forms[i] = None, FULL  # recomputed, it is exact again
        session.changed()

    def cut(self, session: SimSession, valid: int) -> None:
        """Keep only the session's KV of tokens [0, valid): the chunks after are dropped and
        the last one trimmed (a new prompt reuses that much of the history)."""
        keep = math.ceil(valid / self.deployment.chunk_tokens)
        for index in range(keep, len(session.tiers)):
            self.drop(session, index)
        session.truncate(keep)
        self._trim_last_chunk(session, valid)

    def _trim_last_chunk(self, session: SimSession, valid: int) -> None:
        """A device chunk the new prompt reuses only part of keeps that part's pages; the
        rest is freed (its blocks hold the old turn's tail, which the prompt does not)."""
        index = len(session.tiers) - 1
        if index < 0 or session.tiers[index] != "device":
            return
        size = self.deployment.kv_bytes(valid - index * self.deployment.chunk_tokens)
        if size < session.sizes[index]:
            if session.copied[index]:
                self.uncopy(session, index)  # the copy holds the old, longer chunk
            self.pool.used -= session.sizes[index] - size
            self.pool.epoch += 1
            session.sizes[index] = size
            session.changed()

    def revive_kept(self, session: SimSession) -> None:
        """A turn arrives: its chunks whose device pages are still kept are on the device
        again, with no load. A full-precision copy in the top tier stays as a clean copy
        (moving the chunk down again then costs no transfer); any other stored copy goes."""
        for i, tier in enumerate(session.tiers):
            size = self.pool.forget_kept(session.session_id, i)
            if size is None or tier is None or tier == "device":
                continue  # no pages kept, or nothing stored below to give up
            stored_full = session.forms[i] == FULL and i not in session.full
            if tier == self.top_tier and stored_full and size == self.full_chunk_bytes:
                self.add_copy(session, i)
            else:  # the device holds it again: the stored copy is freed unread
                self.store.delete(session.chunk(i).id)
                self.dropped[tier] += session.sizes[i]
            session.tiers[i], session.forms[i] = "device", FULL
            session.sizes[i] = session.full.pop(i, session.sizes[i])
            self.pool.used += size
        session.changed()

    # -- write-through copies ----------------------------------------------------------

    def add_copy(self, session: SimSession, i: int) -> None:
        """Chunk `i`, on the device, now also has a copy in the top tier."""
        session.copied[i] = True
        self.copies[(session.session_id, i)] = session
        self.copy_bytes += session.sizes[i]

    def forget_copy(self, session: SimSession, i: int) -> None:
        """Chunk `i`'s copy is no copy any more (it became the chunk, or is deleted)."""
        session.copied[i] = False
        del self.copies[(session.session_id, i)]
        self.copy_bytes -= session.sizes[i]

    def uncopy(self, session: SimSession, i: int) -> None:
        """Delete chunk `i`'s copy from the top tier."""
        self.forget_copy(session, i)
        self.store.delete(session.chunk(i).id)
        self.dropped[self.top_tier] += session.sizes[i]

    def reclaim(self, tier: SizeOnlyTier, size: int) -> None:
        """Drop the oldest copies until `size` bytes fit: they only save a future transfer."""
        while not tier.fits(size) and self.copies:
            session_id, i = next(iter(self.copies))
            self.uncopy(self.copies[(session_id, i)], i)

    # -- results -------------------------------------------------------------------------

    def tier_counters(self) -> dict[str, dict[str, Any]]:
        """Per lower tier: budget, bytes/ops in and out, bytes dropped, bytes still held."""
        if self.store is None:
            return {}
        out = {}
        for name, tier in self.store.tiers.items():
            stats = tier.stats
            out[name] = {
                "capacity_bytes": tier.capacity_bytes,
                "bytes_written": stats.bytes_written,
                "bytes_read": stats.bytes_read,
                "bytes_dropped": self.dropped[name],
                "resident_bytes": tier.used_bytes,
                "writes": stats.writes,
                "reads": stats.reads,
            }
        return out
