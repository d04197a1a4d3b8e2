"""IdleBlocks: finished requests' blocks that vLLM keeps in its prefix cache, and the retention
policy's orders on them. Runs in vLLM's scheduler, where vLLM's block pool is.

Ownership and failure rules first:

- vLLM owns every block. A finished request's full blocks stay cached and free (ref count 0)
  until vLLM hands them out again, LRU first. kvtier only remembers which they were (block id
  -> vLLM's hash at the finish), so the worker's retention policy sees a paused session's KV
  on the device, as in kvtier's own engine, and may order it down.
- A block leaves this record ("gone") in the step vLLM hands it to a request (the step's new
  blocks, prefix hits included): the worker learns it with that step's messages, before its
  forward, so it never reads a block whose content is no longer the finished request's.
- An order (`evict`, `keep`) is applied only to a block still idle (ref count 0) under the
  hash it had: one reused or hit in between is left alone. An order is never a loss: `evict`
  follows a move down (a tier holds the chunk, written through as it filled) or the policy's
  drop; a later turn then loads the chunk or recomputes it.
  - `evict`: the block stops being hittable and goes to the front of vLLM's free queue, so
    vLLM reuses it before the blocks the policy kept. vLLM's `BlockRemoved` event says so.
  - `keep` (`keep_moved`): still hittable, but reused first.
"""

from __future__ import annotations

from typing import Any


class IdleBlocks:
    def __init__(self) -> None:
        self._hash_of: dict[int, Any] = {}  # block id -> vLLM's block hash at the finish
        self._gone: list[int] = []

    def __len__(self) -> int:
        return len(self._hash_of)

    def remember(self, pool: Any, block_ids: list[int]) -> list[int]:
        """A request finished with `block_ids`: its leading blocks vLLM keeps cached (full and
        hashed), remembered and returned."""
        cached: list[int] = []
        for block_id in block_ids:
            block_hash = pool.blocks[block_id].block_hash
            if block_hash is None:  # the partial last block, or caching off: not hittable
                break
            self._hash_of[block_id] = block_hash
            cached.append(block_id)
        return cached

    def handed_out(self, block_ids: list[int]) -> None:
        """vLLM gave these blocks to a request this step (new or hit): forgotten."""
        for block_id in block_ids:
            if self._hash_of.pop(block_id, None) is not None:
                self._gone.append(block_id)

    def take_gone(self) -> tuple[int, ...]:
        gone, self._gone = tuple(self._gone), []
        return gone

    def clear(self) -> None:
        """vLLM's prefix cache was reset: nothing remembered is hittable any more."""
        self._gone.extend(self._hash_of)
        self._hash_of.clear()

    def apply(self, pool: Any, evict: list[int], keep: list[int]) -> None:
        for block_id in evict:
            block = self._idle(pool, block_id)
            if block is None:
                continue
            # out of the free queue, unhashed (vLLM's own eviction, with its event), and back
            # in: an unhashed free block goes to the front
            pool.touch([block])
            pool.evict_blocks({block_id})
            pool.free_blocks([block])
        queue = getattr(pool, "free_block_queue", None)
        for block_id in keep:
            block = self._idle(pool, block_id)
            if block is None or queue is None:
                continue
            queue.remove(block)
            queue.prepend_n([block])

    def _idle(self, pool: Any, block_id: int) -> Any:
        expected = self._hash_of.pop(block_id, None)
        block = pool.blocks[block_id] if 0 <= block_id < len(pool.blocks) else None
        if expected is None or block is None or block.ref_cnt or block.block_hash != expected:
            return None  # reused or hit since the order: vLLM's now
        return block
