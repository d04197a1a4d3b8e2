"""DevicePool: a simulated replica's device KV memory, in bytes, as the engine's block pool
(`kvtier.engine.block_pool`) holds it in blocks.

- `used`: bytes held by idle KV, running requests, loads and spills in flight; `pending_free`
  is the part being spilled (a chunk frees as its copy lands).
- `epoch` changes whenever memory frees up or new idle KV appears, so admission knows when
  asking the policy again could help.
- Kept pages (`keep_moved`): the device pages of chunks a policy moved down stay until the
  pool needs them. They are not in `used` (they are free to the policy), and the pool takes
  them back least recently used first, a session's tail before its head, as a prefix cache's
  LRU does, whenever an allocation would not fit beside them (`reuse_kept`).
"""

from __future__ import annotations

from kvtier.oldest_first import OldestFirst
from kvtier.sim.session import SimSession


class DevicePool:
    def __init__(self, capacity: int, keep_moved: bool) -> None:
        self.capacity = capacity
        self.used = 0
        self.pending_free = 0
        self.epoch = 0
        self.keep_moved = keep_moved
        # (session id, chunk) -> device bytes of a moved chunk's kept pages
        self.kept: dict[tuple[str, int], int] = {}
        self._kept_order: OldestFirst[tuple[str, int]] = OldestFirst()
        self.kept_bytes = 0

    def allocate(self, nbytes: int) -> None:
        """Hold `nbytes` more (fewer when negative), taking kept pages back if needed."""
        self.used += nbytes
        self.reuse_kept()

    def keep(self, session: SimSession, i: int, size: int) -> None:
        """Chunk `i`'s `size` device bytes just left `used` for a lower tier: with keep_moved,
        its pages stay, free but still there, until the pool needs them."""
        if self.keep_moved:
            key = (session.session_id, i)
            self.kept[key] = size
            self.kept_bytes += size
            self._kept_order.add(key, (session.access[i], -i))
            self.reuse_kept()

    def forget_kept(self, session_id: str, i: int) -> int | None:
        """Take chunk `i`'s kept pages out (they are used again, or their chunk is gone): their
        bytes, or None if none were kept."""
        key = (session_id, i)
        if key not in self.kept:
            return None
        size = self.kept.pop(key)
        self.kept_bytes -= size
        self._kept_order.discard(key)
        return size

    def reuse_kept(self) -> None:
        """The pool takes kept pages back, least recently used first, as memory is allocated."""
        while self.kept and self.used + self.kept_bytes > self.capacity:
            self.kept_bytes -= self.kept.pop(self._kept_order.pop_oldest())
