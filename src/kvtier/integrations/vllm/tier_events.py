"""TierEventLog: which of vLLM's blocks each kvtier tier gains and loses, for KV events.

Ownership: the worker side (`EngineTiers`) owns one when vLLM's KV events are on. The
store's placement listener (`TieredStore.listener`) feeds it from whichever thread moves a
chunk (often the mover's worker); everything else (`describe`, `take`) runs on vLLM's worker
thread, the only one that reads its tables.

Failure rules: events are best effort. A router that misses one sends a request where its
KV is not, which costs a recompute, never a wrong token; so nothing here may fail a step.
Placements waiting to be taken are bounded (`max_pending`): when nobody takes them, the
oldest are dropped and counted (`dropped`).

What a chunk is in vLLM's words: kvtier names a chunk by its own block keys, which vLLM's
block hashes cannot be derived from. The worker learns a chunk's vLLM blocks when a request
that holds it is saved (`describe`: the hashes, the parent hash and the tokens vLLM's
scheduler computed). A chunk this process never saw a request for (one another replica wrote
to the shared tier, or a persistent disk tier kept from an earlier run) is tracked but not
announced (`unannounced`) until a request that holds it is saved here.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvtier.integrations.vllm.messages import Save
from kvtier.integrations.vllm.requests import RequestRecord
from kvtier.tiers import TieredStore, chunk_id

STORED: Literal["stored"] = "stored"
REMOVED: Literal["removed"] = "removed"


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """A chunk as vLLM's prefix cache names it: its blocks' hashes (vLLM's, as bytes), the
    hash of the block before it (None for a sequence's first chunk), its token ids, and the
    cache salt when the chunk starts the sequence (vLLM's extra key of block 0)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: array[int]
    block_size: int
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class TierEvent:
    kind: Literal["stored", "removed"]
    tier: str
    blocks: ChunkBlocks


class TierEventLog:
    def __init__(
        self,
        store: TieredStore,
        in_flight: Callable[[bytes], bool],
        max_pending: int = 65_536,
    ) -> None:
        """in_flight(chunk id): a write of it is queued and not finished (its placement is
        still to come)."""
        self._store = store
        self._in_flight = in_flight
        self._pending: deque[tuple[bytes, str | None, str | None]] = deque(maxlen=max_pending)
        self._count_lock = threading.Lock()
        self.dropped = 0  # placements lost because nobody took them in time
        self.unannounced = 0  # placements of chunks whose vLLM blocks are not known here
        # chunk id -> the tier it is in, as of the placements taken so far (the store's index,
        # one tier per chunk); seeded with what the store holds now (recovered at start)
        self._where: dict[bytes, str] = {
            cid: tier for tier in store.order for cid in store.chunks_in(tier)
        }
        self._blocks: dict[bytes, ChunkBlocks] = {}
        self._announced: dict[bytes, str] = {}  # chunk id -> the tier a router was told
        self._described: list[bytes] = []  # since the last take
        store.listener = self._placed

    def _placed(self, chunk_id: bytes, left: str | None, entered: str | None) -> None:
        # under the store's lock: an append, nothing more
        pending = self._pending
        if len(pending) == pending.maxlen:
            with self._count_lock:
                self.dropped += 1
        pending.append((chunk_id, left, entered))

    def describe(self, chunk_id: bytes, blocks: ChunkBlocks) -> None:
        """The vLLM blocks of a chunk a request holds (saved this step): its placements are
        announced from now on, the current one at the next `take`."""
        if chunk_id not in self._blocks:
            self._described.append(chunk_id)
        self._blocks[chunk_id] = blocks

    def take(self) -> list[TierEvent]:
        """What the tiers gained and lost since the last take, in order."""
        # chunks whose entry may go: not placed, no write coming. Picked before the pending
        # placements are read, so a placement that lands meanwhile is read with its entry.
        stale = []
        if len(self._blocks) > 2 * len(self._where) + 64:
            stale = [c for c in self._blocks if c not in self._where and not self._in_flight(c)]
        events: list[TierEvent] = []
        pending = self._pending
        while pending:
            chunk_id, left, entered = pending.popleft()
            if left is not None and self._where.get(chunk_id) == left:
                del self._where[chunk_id]
            if entered is not None:
                self._where[chunk_id] = entered
            blocks = self._blocks.get(chunk_id)
            if blocks is None:
                self.unannounced += 1
                continue
            if left is not None and self._announced.get(chunk_id) == left:
                del self._announced[chunk_id]
                events.append(TierEvent(REMOVED, left, blocks))
            if entered is not None and self._announced.get(chunk_id) != entered:
                self._announced[chunk_id] = entered
                events.append(TierEvent(STORED, entered, blocks))
        for chunk_id in self._described:  # placed before their blocks were known
            tier = self._where.get(chunk_id)
            if tier is not None and self._announced.get(chunk_id) != tier:
                self._announced[chunk_id] = tier
                events.append(TierEvent(STORED, tier, self._blocks[chunk_id]))
        self._described.clear()
        for chunk_id in stale:
            if chunk_id not in self._where:
                self._blocks.pop(chunk_id, None)
                self._announced.pop(chunk_id, None)
        return events


def chunk_blocks(
    block_hashes: Sequence[bytes],
    first_block: int,
    num_blocks: int,
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
) -> ChunkBlocks:
    """The chunk of blocks [first_block, first_block + num_blocks) of a sequence whose vLLM
    hashes are `block_hashes` (from block 0) and tokens `token_ids` (from token 0)."""
    end = first_block + num_blocks
    return ChunkBlocks(
        tuple(block_hashes[first_block:end]),
        block_hashes[first_block - 1] if first_block else None,
        array("i", token_ids[first_block * block_size : end * block_size]),
        block_size,
        cache_salt if first_block == 0 else None,
    )


def describe_saved(
    log: TierEventLog,
    record: RequestRecord,
    save: Save,
    keys: Sequence[bytes],
    blocks_per_chunk: int,
    block_size: int,
) -> None:
    """Tell `log` the vLLM blocks of the full chunks a save copies out; `record` (the worker's
    copy of the request) first takes the save's block hashes. A chunk whose hashes did not
    come (vLLM hashes blocks of another size than it caches, or not yet) stays undescribed."""
    hashes = record.block_hashes
    if save.block_hashes:
        hashes[save.hashes_from : save.hashes_from + len(save.block_hashes)] = save.block_hashes
    k = blocks_per_chunk
    for chunk in range(save.first_chunk, save.end_chunk):
        first = chunk * k
        if first + k > min(len(keys), len(hashes)):
            break
        blocks = chunk_blocks(hashes, first, k, record.all_token_ids, block_size, record.cache_salt)
        log.describe(chunk_id(keys[first : first + k]), blocks)
