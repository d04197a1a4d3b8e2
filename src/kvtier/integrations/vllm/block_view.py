"""VllmBlockView: what kvtier's cache parts see of vLLM's block pool.

kvtier's `Chunks`, `Spiller` and `PolicyRunner` ask a block pool which device block holds a
key. vLLM's pool is its own and keyed by vLLM's hashes, so this view knows two kinds of block:

- the blocks of a sequence the connector is saving right now (`bind`, for the duration of the
  save, while vLLM holds them): write-through gathers them through the port;
- finished requests' blocks vLLM keeps cached, idle (`idle`, from each `Finish`; forgotten
  in the step vLLM hands one out, `forget`). They are what the retention policy sees of a
  paused session on the device (`resident`), and what it may move down or drop: its orders
  (`drop_cached`, `keep`) go back to the scheduler, which applies them to vLLM's pool
  (`idle_blocks.py`). Only the policy reaches them through `lookup`, inside `acting()`:
  loads are planned from vLLM's own hits, never from this view's idea of vLLM's cache.

Its counts are vLLM's as of the step's schedule (`update`): vLLM counts idle cached blocks as
free (it evicts them on demand), kvtier's pressure trigger as held. Free here means neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from kvtier.integrations.vllm.messages import DeviceState
from kvtier.vocab import FULL


class _AllFull:
    """Every vLLM block holds full-precision KV (kvtier restores into vLLM unquantized)."""

    def __getitem__(self, block_id: int) -> str:
        return FULL


class _Refs:
    """A block is idle (0) when it is a finished request's cached block; any other is vLLM's
    in use, as far as kvtier may act on it."""

    def __init__(self, view: VllmBlockView) -> None:
        self._view = view

    def __getitem__(self, block_id: int) -> int:
        return 0 if block_id in self._view._keys_of else 1


class VllmBlockView:
    num_kept = 0  # vLLM keeps no block aside from its free queue
    num_kept_hits = 0

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.forms = _AllFull()
        self.ref_counts = _Refs(self)
        self._bound: dict[bytes, int] = {}
        self._idle: dict[bytes, int] = {}  # key -> vLLM's idle cached block holding it
        self._keys_of: dict[int, set[bytes]] = {}
        self._free_blocks = num_blocks  # vLLM's, as of the last schedule (idle cached included)
        self._acting = False
        self.evict: list[int] = []  # the policy's orders, until the step's reply takes them
        self.keep_ids: list[int] = []

    @contextmanager
    def bind(self, keys: Sequence[bytes], block_ids: Sequence[int]):
        """Make `keys` resolve to vLLM's `block_ids` inside the block (a sequence being
        saved); forgotten after, since vLLM may reuse the blocks once it frees them."""
        self._bound = dict(zip(keys, block_ids, strict=False))
        try:
            yield
        finally:
            self._bound = {}

    @contextmanager
    def acting(self):
        """The retention policy's turn: `lookup` finds idle cached blocks too."""
        self._acting = True
        try:
            yield
        finally:
            self._acting = False

    # ----- what vLLM's scheduler reported ------------------------------------------------

    def idle(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """A finished request's cached blocks, by position with its block keys."""
        for key, block_id in zip(keys, block_ids, strict=False):
            old = self._idle.get(key)
            if old is not None and old != block_id:
                self._unlink(key, old)
            self._idle[key] = block_id
            self._keys_of.setdefault(block_id, set()).add(key)

    def forget(self, block_ids: Sequence[int]) -> None:
        """vLLM handed these blocks out: their content is no longer what the keys name."""
        for block_id in block_ids:
            for key in self._keys_of.pop(block_id, ()):
                if self._idle.get(key) == block_id:
                    del self._idle[key]

    def update(self, state: DeviceState) -> None:
        self.forget(state.gone)
        self._free_blocks = state.free_blocks

    def take_orders(self) -> tuple[list[int], list[int]]:
        orders = (self.evict, self.keep_ids)
        self.evict, self.keep_ids = [], []
        return orders

    def _unlink(self, key: bytes, block_id: int) -> None:
        keys = self._keys_of.get(block_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_of[block_id]

    # ----- the block pool's interface ----------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        found = self._bound.get(key)
        if found is None and self._acting:
            found = self._idle.get(key)
        return found

    def resident(self, key: bytes) -> int | None:
        found = self._bound.get(key)
        return self._idle.get(key) if found is None else found

    def set_form(self, block_id: int, form: str) -> None:
        return None  # restored blocks are written in the pool's own dtype

    def drop_cached(self, block_ids: list[int]) -> int:
        """The policy moved or dropped these blocks' chunk: vLLM evicts them, reuses them first."""
        ids = [b for b in block_ids if b in self._keys_of]
        self.forget(ids)
        self.evict += ids
        return len(ids)

    def keep(self, block_ids: list[int]) -> int:
        """... or, with `keep_moved`, keeps them hittable and reuses them first."""
        ids = [b for b in block_ids if b in self._keys_of]
        self.forget(ids)
        self.keep_ids += ids
        return len(ids)

    # what a policy's pressure trigger and its view of the device read
    @property
    def num_free(self) -> int:
        """Blocks free and holding no finished request's KV: what vLLM hands out without
        evicting a paused session."""
        return max(0, self._free_blocks - len(self._keys_of))

    @property
    def num_allocatable(self) -> int:
        return self.num_free
