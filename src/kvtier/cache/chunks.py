"""Chunks: the fixed grid of blocks a sequence moves in, and where each chunk is now.

A chunk is `blocks_per_chunk` consecutive full blocks of one sequence, on a grid from its
first block, named by its blocks' keys and the tenant namespace (`kvtier.tiers.Chunk`). It is
either on the device (its blocks cached in the pool), stored in one tier, or being written
(its bytes staged in host memory until the mover's worker lands them). Restore, spill and the
policy runner all ask this one place, so they agree on what "stored" means.

A stored chunk also serves a later prompt that shares only a prefix of its blocks, as the
device's prefix cache serves any shared run of blocks: a finished turn's last chunk holds the
start of its answer, and the next prompt often resends that answer as text that tokenizes
differently (or not at all), so it shares the chunk's prompt blocks and not the rest. Block
keys are chained (each hashes its parent), so a stored run that starts with the prompt's key
at a grid position shares exactly its common prefix with the prompt; `put` remembers each
run this process writes by its first key (`find_stored` looks there).
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
from kvtier.vocab import FULL


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
        # (first key, namespace) -> the key runs of chunks written from here that start
        # with it; entries whose chunk has left every tier are dropped when met
        self._runs: dict[tuple[bytes, str], set[tuple[bytes, ...]]] = {}

    @staticmethod
    def namespace_of(request: Request) -> str:
        return request.tenant or "default"

    def chunk_keys(self, keys: Sequence[bytes]) -> list[tuple[bytes, ...]]:
        k = self.blocks_per_chunk
        return [tuple(keys[i : i + k]) for i in range(0, len(keys), k)]

    def put(
        self,
        chunk: Chunk,
        payload: Payload,
        tier: str | None,
        on_done: Callable[[bool], None],
        form: str = FULL,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Write `chunk` in the background (`BackgroundWrites.put`), remembering its run of
        keys so that a prompt sharing only a prefix of it finds it too."""
        self.writes.put(chunk, payload, tier, on_done, form, ready=ready)
        if len(self._runs) > 2 * len(self.store) + 64:  # bounded by what is stored
            self._runs = {
                start: live for start, runs in self._runs.items() if (live := self._live(runs))
            }
        self._runs.setdefault((chunk.keys[0], chunk.namespace), set()).add(chunk.keys)

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
    ) -> tuple[Chunk, int] | None:
        """The stored chunk on the grid at `chunk_index` that shares the most blocks with
        `keys` there, covering block `covering`, and how many it shares (its leading blocks).

        A chunk stored by an earlier, shorter turn holds fewer keys than the grid allows, so
        lengths are tried from the longest down; then the runs written from here that go on
        beyond what `keys` share (a turn's answer the next prompt does not resend as it was)."""
        k = self.blocks_per_chunk
        first = chunk_index * k
        longest = min(k, len(keys) - first)
        for length in range(longest, covering - first, -1):
            chunk = Chunk(tuple(keys[first : first + length]), namespace)
            if self.locate(chunk.id) is not None:
                return chunk, length
        start = (keys[first], namespace) if longest > 0 else None
        runs = self._runs.get(start) if start is not None else None
        if not runs:
            return None
        live = self._live(runs)
        if not live:
            del self._runs[start]
            return None
        self._runs[start] = live
        wanted = keys[first : first + longest]
        shared, run = max((common_prefix(wanted, run), run) for run in live)
        return (Chunk(run, namespace), shared) if shared > covering - first else None

    def _live(self, runs: set[tuple[bytes, ...]]) -> set[tuple[bytes, ...]]:
        """Those of `runs` whose chunk is still stored (or being written); a chunk's id
        is its keys' hash (the namespace is in the keys)."""
        return {run for run in runs if self.locate(Chunk(run).id) is not None}

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


def common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
