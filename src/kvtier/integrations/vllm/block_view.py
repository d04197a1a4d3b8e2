"""VllmBlockView: what kvtier's cache parts see of vLLM's block pool.

kvtier's `Chunks`, `Spiller` and `PolicyRunner` ask a block pool which device block holds a
key (`lookup`). vLLM's pool is its own and keyed by vLLM's hashes, so this view answers only
for the blocks of a sequence the connector is saving right now (`bind` for the duration of
`request_finished`, when vLLM still holds them): then write-through gathers them through the
port. At any other time no key is on "the device" as far as kvtier can act on it, so a
policy never tries to evict or move vLLM's blocks; it moves and drops stored chunks only.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from kvtier.vocab import FULL


class _AllFull:
    """Every vLLM block holds full-precision KV (kvtier restores into vLLM unquantized)."""

    def __getitem__(self, block_id: int) -> str:
        return FULL


class _NoRefs:
    def __getitem__(self, block_id: int) -> int:
        return 1  # owned by vLLM: never idle from kvtier's side


class VllmBlockView:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.forms = _AllFull()
        self.ref_counts = _NoRefs()
        self._bound: dict[bytes, int] = {}

    @contextmanager
    def bind(self, keys: Sequence[bytes], block_ids: Sequence[int]):
        """Make `keys` resolve to vLLM's `block_ids` inside the block (a sequence being
        saved); forgotten after, since vLLM may reuse the blocks once it frees them."""
        self._bound = dict(zip(keys, block_ids, strict=False))
        try:
            yield
        finally:
            self._bound = {}

    def lookup(self, key: bytes) -> int | None:
        return self._bound.get(key)

    def resident(self, key: bytes) -> int | None:
        return self._bound.get(key)

    def set_form(self, block_id: int, form: str) -> None:
        return None  # restored blocks are written in the pool's own dtype

    def drop_cached(self, block_ids: list[int]) -> int:
        return 0  # vLLM's prefix cache is vLLM's to evict

    def keep(self, block_ids: list[int]) -> int:
        return 0  # ... and vLLM keeps a freed block hittable until it reuses it anyway

    # what a policy's pressure trigger reads: vLLM does not show a connector its free blocks
    @property
    def num_free(self) -> int:
        return self.num_blocks

    @property
    def num_allocatable(self) -> int:
        return self.num_blocks

    num_kept = 0
