"""The policy executor's target over the tiered connector: one chunk of a remembered session
moved down or dropped on the engine's real blocks and tiers (`kvtier.policy.executor`).

- `move` of a chunk on the device: its leading run of device blocks is copied out as ONE
  payload (one gather into host memory) and its idle device blocks are freed (with
  `keep_moved`, kept: reused first, hittable until then); the write into the tier runs on
  the mover's worker. If a tier already holds that run (a write-through
  copy), that copy is demoted instead. Blocks in use by a request refuse the move (`in_use`).
- `move` of a chunk in a lower tier: the store demotes it, also on the worker.
- A moved chunk is stored at the less precise of the asked form and the tier's own
  (`TiersConfig.forms`).
- `drop`: idle device blocks freed, every stored prefix-length variant deleted (in the
  background).

Blocks other remembered sessions hold (a shared system prompt or document, found through the
prefix cache) are never freed for one session's sake. The engine thread never waits for a tier
here: a write that later fails (or finds the queue full) only means the chunk is recomputed
when it is needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import TYPE_CHECKING

from kvtier.cache.forms import lossiest
from kvtier.tiers import Chunk
from kvtier.vocab import DEVICE

if TYPE_CHECKING:
    from kvtier.cache.connector_parts import ConnectorParts

ChunkKeys = tuple[bytes, ...]


@dataclass
class SessionKeys:
    """A remembered session's block keys, in order, and its tenant namespace."""

    keys: tuple[bytes, ...]
    namespace: str


class _ChunkTiers(Sequence[str | None]):
    """Where each chunk of a session is, looked up when asked (a policy's action names one
    chunk of a session that may have hundreds)."""

    def __init__(self, chunks: ConnectorChunks, split: list[ChunkKeys], namespace: str) -> None:
        self._chunks, self._split, self._namespace = chunks, split, namespace

    def __len__(self) -> int:
        return len(self._split)

    def __getitem__(self, index: int) -> str | None:  # type: ignore[override]
        return self._chunks.tier_of(self._split[index], self._namespace)


class ConnectorChunks:
    """`ChunkTarget` for the engine: sessions are those the policy runner remembers
    (`sessions`), `holders` counts how many of them hold each block key."""

    def __init__(
        self,
        connector: ConnectorParts,
        sessions: Mapping[str, SessionKeys],
        holders: Counter[bytes],
    ) -> None:
        self.connector = connector
        self.sessions = sessions
        self.holders = holders
        # the last session's chunk split: a policy's actions for one session come in a row
        self._split: tuple[SessionKeys, list[ChunkKeys]] | None = None

    @property
    def tiers(self) -> Sequence[str]:
        return list(self.connector.store.tiers)

    def chunks(self, session_id: str) -> Sequence[str | None] | None:
        stored = self.sessions.get(session_id)
        if stored is None:
            return None
        return _ChunkTiers(self, self._chunk_split(stored), stored.namespace)

    def tier_of(self, keys: ChunkKeys, namespace: str) -> str | None:
        """The device if any of the chunk's blocks is there (as the policy's view says), else
        the tier holding the chunk or, failing that, a shorter stored variant of it (the
        partial last chunk of an earlier turn)."""
        c = self.connector
        if any(c.block_pool.resident(k) is not None for k in keys):
            return DEVICE
        for length in range(len(keys), 0, -1):
            where = c.locate(Chunk(keys[:length], namespace).id)
            if where is not None:
                return where
        return None

    def move(self, session_id: str, index: int, tier: str, form: str) -> str | None:
        c = self.connector
        keys, namespace = self._chunk(session_id, index)
        pool = c.block_pool
        ids = [pool.resident(k) for k in keys]
        if ids[0] is None:  # stored below: stray device blocks go, kept ones stay kept
            c.drop_device_blocks(
                self.own_keys([k for k, b in zip(keys, ids, strict=True) if b is not None])
            )
            return self._demote(Chunk(keys, namespace), tier, form)
        run = list(takewhile(lambda block: block is not None, ids))
        if any(pool.ref_counts[b] for b in run):
            return "in_use"
        chunk = Chunk(keys[: len(run)], namespace)
        where = c.locate(chunk.id)
        refused = None
        if where is None:
            payload, ready = c.gather(run)

            def done(ok: bool, nbytes: int = payload.nbytes) -> None:
                name = f"policy_moved_bytes_device->{tier}" if ok else "spill_failures"
                c.counters[name] += nbytes if ok else 1

            c.chunks.put(chunk, payload, tier, done, lossiest(form, c.form_of(run)), ready=ready)
        elif where != tier:
            refused = self._demote(chunk, tier, form)
        c.free_moved_blocks(
            self.own_keys([k for k, b in zip(keys, ids, strict=True) if b is not None])
        )
        return refused

    def drop(self, session_id: str, index: int) -> None:
        self.drop_keys(*self._chunk(session_id, index))

    def flush(self) -> None:
        """Nothing to batch: each write was queued on the mover as it was decided."""

    def drop_keys(self, keys: ChunkKeys, namespace: str, holders: int = 1) -> None:
        """Drop one chunk given by its keys (`holders`: how many holders of a key the acting
        session itself counts for; 0 once it is forgotten)."""
        c = self.connector
        dropped = c.drop_device_blocks(self.own_keys(keys, holders))
        c.counters["policy_dropped_blocks"] += dropped
        # every stored prefix-length variant of this chunk goes too
        for length in range(len(keys), 0, -1):
            chunk_id = Chunk(keys[:length], namespace).id
            if c.locate(chunk_id) is not None:
                c.writes.delete(chunk_id)
                c.counters["policy_deleted_chunks"] += 1

    def own_keys(self, keys: Sequence[bytes], holders: int = 1) -> list[bytes]:
        """The keys no other remembered session holds. Dropping a shared block would cut every
        other session's prefix chain at that block: all of their history after it would be
        recomputed."""
        return [k for k in keys if self.holders[k] <= holders]

    def _demote(self, chunk: Chunk, tier: str, form: str) -> str | None:
        c = self.connector
        where = c.locate(chunk.id)
        if where is None:
            return "not_stored"
        order = self.tiers
        if order.index(tier) <= order.index(where):
            return "move_up"
        nbytes = len(chunk.keys) * c.bytes_per_block

        def done(ok: bool) -> None:
            name = f"policy_moved_bytes_{where}->{tier}" if ok else "demote_failures"
            c.counters[name] += nbytes if ok else 1

        # Queued behind a put of the same chunk still in flight, so it demotes what landed.
        c.writes.demote(chunk.id, tier, done, form)
        return None

    def _chunk(self, session_id: str, index: int) -> tuple[ChunkKeys, str]:
        stored = self.sessions[session_id]
        return self._chunk_split(stored)[index], stored.namespace

    def _chunk_split(self, stored: SessionKeys) -> list[ChunkKeys]:
        if self._split is None or self._split[0] is not stored:
            self._split = (stored, self.connector.chunk_keys(stored.keys))
        return self._split[1]
