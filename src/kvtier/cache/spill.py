"""Spiller: device blocks copied out to the top tier: on eviction, on preemption, on finish.

- `on_block_evicted`: the pool is about to reuse an idle cached block. When spilling is on,
  the block's whole chunk (on the grid from its sequence's first block) is copied out as one
  payload (one gather through the block port: the only part the engine thread pays) and
  queued on the mover, whose worker writes it into the top tier and runs the store's cascade
  of demotions; the chunk's other blocks stay on the device, and later evictions find the
  chunk stored or in flight. With spilling off (`retain`, `recompute`) the block is dropped,
  unless it belongs to a preempted request (swap-out, `swap_on_preempt`).
- `remember`: a finished (or preempted) request's computed full blocks are mapped to their
  chunks, so an eviction knows which chunk a block belongs to.
- `write_through`: a finished request's full chunks no tier holds are gathered and queued now,
  so evicting them later costs no copy ("selective": only those its prompt reused).
- `drop_device_blocks`: a policy's eviction of idle blocks, not spilled.
- `forget`: an engine that never reports evictions (vLLM frees its blocks without telling a
  connector) drops the mapping `remember` made, so it does not grow without bound.
- `unstored_chunks`: what the device holds and no tier does, for a connector that closes
  (`shutdown_flush.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from kvtier.cache.chunks import Chunks
from kvtier.engine.request import Request
from kvtier.tiers import Chunk


class _ChunkOf(NamedTuple):
    """The chunk a cached block belongs to, and whether it was marked for swap-out."""

    keys: tuple[bytes, ...]
    namespace: str
    swap: bool = False


class Spiller:
    def __init__(
        self,
        chunks: Chunks,
        spill_on_evict: bool,
        write_through: bool | str,
        counters: Counter[str],
    ) -> None:
        self.chunks = chunks
        self.spill_on_evict = spill_on_evict
        self.write_through = bool(write_through) and spill_on_evict
        self.selective = write_through == "selective"
        self.counters = counters
        # block key -> its chunk in the latest finished (or preempted) sequence
        self._chunk_of: dict[bytes, _ChunkOf] = {}
        self._suppress = False

    def remember(self, request: Request, swap: bool) -> list[bytes]:
        """Map each computed full block's key to its chunk; returns those keys."""
        bs = self.chunks.block_size
        keys = request.keys_of_full_blocks(bs)[: request.num_computed_tokens // bs]
        namespace = self.chunks.namespace_of(request)
        for chunk in self.chunks.chunk_keys(keys):
            for key in chunk:
                self._chunk_of[key] = _ChunkOf(chunk, namespace, swap)
        return keys

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop what `remember` mapped for these keys (no eviction of them will be reported)."""
        for key in keys:
            self._chunk_of.pop(key, None)

    def on_block_evicted(self, key: bytes) -> None:
        info = self._chunk_of.pop(key, None)
        if self._suppress or not (self.spill_on_evict or (info is not None and info.swap)):
            self.counters["evicted_dropped"] += 1
            return
        if info is None:
            self.counters["evicted_unknown"] += 1
            return
        c = self.chunks
        if c.locate(Chunk(info.keys, info.namespace).id) is not None:
            return  # already stored or in flight (an earlier block of the chunk spilled it)
        ids = c.device_blocks(info.keys)
        if len(ids) <= info.keys.index(key):
            self.counters["evicted_dropped"] += 1  # a gap before it: unreachable anyway
            return
        chunk = Chunk(info.keys[: len(ids)], info.namespace)
        if c.locate(chunk.id) is not None:
            return
        # The gather is the copy out of the device block, so the pool may reuse the block as
        # soon as this returns; the tier write happens on the mover's worker.
        payload, ready = c.gather(ids)
        kind = "swapped" if info.swap else "spilled"
        blocks = len(ids)

        def done(ok: bool) -> None:
            if ok:
                self.counters[f"{kind}_chunks"] += 1
                self.counters[f"{kind}_blocks"] += blocks
                self.counters[f"{kind}_bytes"] += payload.nbytes
            else:
                self.counters["spill_failures"] += 1  # dropped (queue full) or failed

        c.put(chunk, payload, None, done, c.form_of(ids), ready=ready)

    def write_through_chunks(
        self, keys: Sequence[bytes], namespace: str, reused_blocks: int | None = None
    ) -> None:
        """Queue each full chunk of a finished request that no tier holds (nor is being
        written) for the top tier, its device blocks staying cached. The partial tail chunk
        is left: the next turn extends it into a chunk with another id. A chunk restored from
        a tier this turn is found there and not written again. With `reused_blocks` (the
        selective mode), only chunks within the request's first `reused_blocks` blocks: those
        its prompt found computed already."""
        c = self.chunks
        chunks = c.chunk_keys(keys)
        if reused_blocks is not None:
            chunks = chunks[: reused_blocks // c.blocks_per_chunk]
        for chunk_keys in chunks:
            chunk = Chunk(chunk_keys, namespace)
            if len(chunk_keys) < c.blocks_per_chunk or c.locate(chunk.id) is not None:
                continue
            ids = [b for b in map(c.block_pool.lookup, chunk_keys) if b is not None]
            if len(ids) < len(chunk_keys):
                continue  # some block was never cached: no whole chunk to copy
            payload, ready = c.gather(ids)

            def done(ok: bool, nbytes: int = payload.nbytes) -> None:
                if ok:
                    self.counters["written_through_chunks"] += 1
                    self.counters["written_through_bytes"] += nbytes
                else:
                    self.counters["write_through_failures"] += 1  # queue full, or failed

            c.put(chunk, payload, None, done, c.form_of(ids), ready=ready)

    def unstored_chunks(self) -> list[tuple[Chunk, list[int]]]:
        """The chunks of cached device blocks that `remember` mapped and no tier holds (nor is
        being written), those of the latest finished requests first: each one's leading run
        of cached blocks, with their block ids."""
        c = self.chunks
        seen: set[tuple[tuple[bytes, ...], str]] = set()  # each block of a chunk maps to it
        found: dict[bytes, tuple[Chunk, list[int]]] = {}
        for info in reversed(self._chunk_of.values()):
            if (info.keys, info.namespace) in seen:
                continue
            seen.add((info.keys, info.namespace))
            ids = c.device_blocks(info.keys)
            chunk = Chunk(info.keys[: len(ids)], info.namespace)
            if ids and chunk.id not in found and c.locate(chunk.id) is None:
                found[chunk.id] = (chunk, ids)
        return list(found.values())

    def keep_device_blocks(self, keys: Sequence[bytes]) -> int:
        """A policy moved these keys' chunk down: their idle device blocks become kept, the
        first the pool reuses (with no spill: a tier holds the chunk) and hittable until then."""
        pool = self.chunks.block_pool
        return pool.keep([b for b in (pool.lookup(k) for k in keys) if b is not None])

    def drop_device_blocks(self, keys: Sequence[bytes]) -> int:
        """Evict these keys' idle device blocks without spilling them (a policy decided)."""
        pool = self.chunks.block_pool
        ids = [b for b in (pool.lookup(k) for k in keys) if b is not None]
        self._suppress = True
        try:
            return pool.drop_cached(ids)
        finally:
            self._suppress = False
