"""Chunks: the fixed grid of blocks a sequence moves in, and where each chunk is now.

A chunk is `blocks_per_chunk` consecutive full blocks of one sequence, on a grid from its
first block, named by its blocks' keys and the tenant namespace (`kvtier.tiers.Chunk`). It is
either on the device (its blocks cached in the pool), stored in one tier, or being written
(its bytes staged in host memory until the mover's worker lands them). Restore, spill and the
policy runner all ask this one place, so they agree on what "stored" means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvtier.cache.forms import lossiest
from kvtier.cache.writes import BackgroundWrites
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.connector import KVBlockPort
from kvtier.engine.device_copy import for_device
from kvtier.engine.request import Request
from kvtier.tiers import Chunk, Payload, TieredStore
from kvtier.tiers.vocab import FULL


class Chunks:
    def __init__(
        self,
        block_size: int,
        blocks_per_chunk: int,
        block_pool: BlockPool,
        port: KVBlockPort,
        store: TieredStore,
        writes: BackgroundWrites,
        tier_forms: dict[str, str],
    ) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.block_pool = block_pool
        self.port = port
        self.copy = for_device(port.device)  # how blocks move between pool and host
        self.store = store
        self.writes = writes
        self.tier_forms = tier_forms  # tier -> its form, when not full

    @staticmethod
    def namespace_of(request: Request) -> str:
        return request.tenant or "default"

    def chunk_keys(self, keys: Sequence[bytes]) -> list[tuple[bytes, ...]]:
        k = self.blocks_per_chunk
        return [tuple(keys[i : i + k]) for i in range(0, len(keys), k)]

    def locate(self, chunk_id: bytes) -> str | None:
        """The tier a chunk is in, or being written to; None when it is not (or is being
        deleted)."""
        where = self.locate_form(chunk_id)
        return where[0] if where is not None else None

    def locate_form(self, chunk_id: bytes) -> tuple[str, str] | None:
        """(tier, form) of a chunk stored or being written (the form it will have there)."""
        staged = self.writes.staged(chunk_id)
        if staged is not None:
            return staged.tier, lossiest(staged.form, self.tier_forms.get(staged.tier, FULL))
        if self.writes.deleting(chunk_id):
            return None
        placement = self.store.locate(chunk_id)
        return (placement.tier, placement.form) if placement is not None else None

    def any_stored(self) -> bool:
        """Whether any chunk is stored or being written (the common empty case needs no
        hashing)."""
        return bool(len(self.store)) or self.writes.staging

    def find_stored(
        self, keys: Sequence[bytes], chunk_index: int, namespace: str, covering: int
    ) -> Chunk | None:
        """The longest stored chunk on the grid at `chunk_index` that covers block `covering`.

        A chunk stored by an earlier, shorter turn holds fewer keys than the grid allows, so
        lengths are tried from the longest down."""
        k = self.blocks_per_chunk
        first = chunk_index * k
        longest = min(k, len(keys) - first)
        for length in range(longest, covering - first, -1):
            chunk = Chunk(tuple(keys[first : first + length]), namespace)
            if self.locate(chunk.id) is not None:
                return chunk
        return None

    def cached_run(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, name blocks cached on the device."""
        return len(self.device_blocks(keys))

    def device_blocks(self, keys: Sequence[bytes]) -> list[int]:
        """The device blocks of `keys` up to the first that is not cached."""
        ids: list[int] = []
        for key in keys:
            block = self.block_pool.lookup(key)
            if block is None:
                break
            ids.append(block)
        return ids

    def form_of(self, block_ids: Sequence[int]) -> str:
        """The least precise form among these device blocks (restored ones keep theirs)."""
        return lossiest(*(self.block_pool.forms[b] for b in block_ids))

    def gather(self, block_ids: Sequence[int]) -> tuple[Payload, Callable[[], None]]:
        """The blocks' KV as one contiguous host payload ([n, *block_shape], one copy through
        the pool's block port), and the call that waits until its bytes are there: on CUDA
        the copy runs on a side stream (`kvtier.engine.device_copy`), so whoever reads the
        bytes (the mover's worker) calls it first. The pool may reuse the blocks at once."""
        host = self.copy.save(self.port, block_ids)
        return Payload.of(host.blocks), host.ready

    def load(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Fill these device blocks from `blocks` [n, *block_shape]; the next forward sees
        them (on CUDA the copy is queued on a side stream the compute stream waits for)."""
        self.copy.load(self.port, block_ids, blocks)
