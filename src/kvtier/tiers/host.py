"""Host DRAM tier: one preallocated byte pool cut into fixed-size slots.

The pool is allocated once and touched up front, so the budget is memory the process really
holds and a put is one copy into slots already there: no allocation per chunk. A payload takes
ceil(n / slot_bytes) slots, not necessarily adjacent; a fresh pool hands out adjacent slots and
adjacent slots are copied as one run, so a chunk is usually one copy. Set `slot_bytes` to the
engine's block bytes and a chunk of whole blocks wastes nothing.

On a CUDA machine (`pinned`) a get returns its bytes in pinned memory: that buffer is what a
restore copies to the device, asynchronously only from pinned memory
(`kvtier.engine.device_copy`), and it is the caller's, so the slots can be reused at once while
the copy is in flight. The pool itself is pinned too, so a later zero-copy read of whole runs
can hand its slots to the device directly.

When the pool is full, `put` returns False and the store decides what to evict (its LRU);
the tier has no eviction policy of its own. Host memory is trusted like device memory, so there
is no checksum here (only tiers below the host carry one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvtier.tiers.base import TierBackend
from kvtier.tiers.payload import Payload, empty_bytes
from kvtier.tiers.record import check_out


@dataclass(slots=True)
class _Held:
    slots: list[int]
    runs: list[tuple[int, int]]  # (byte offset in the pool, length): one copy each
    payload: Payload  # metadata only (data=None)


class HostTier(TierBackend):
    in_memory = True

    def __init__(
        self,
        capacity_bytes: int,
        *,
        slot_bytes: int = 256 * 1024,
        pin_memory: bool | None = None,
        prefault: bool = True,
        name: str = "host",
    ) -> None:
        super().__init__(name)
        if slot_bytes <= 0 or capacity_bytes < slot_bytes:
            raise ValueError("host tier needs capacity_bytes >= slot_bytes > 0")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity_bytes // slot_bytes
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._pool = torch.empty(
            self.num_slots * slot_bytes, dtype=torch.uint8, pin_memory=self.pinned
        )
        if prefault and not self.pinned:
            # First-touch page faults would otherwise land on the first puts (and on the
            # benchmark); pinned memory is resident already.
            self._pool.zero_()
        # A stack popped from the end: a fresh pool hands out slots 0, 1, 2, ... (adjacent).
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._held: dict[tuple[str, bytes], _Held] = {}
        # Held across copies too: a slot must not be reused while its bytes are being read.
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes

    def _slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.slot_bytes))

    def fits(self, nbytes: int) -> bool:
        return self._slots_for(nbytes) <= len(self._free)

    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        if payload.data is None:
            raise ValueError("the host tier stores bytes; use SizeOnlyTier for sizes")
        need = self._slots_for(payload.nbytes)
        with self._lock:
            old = self._held.get((namespace, key))
            if need > len(self._free) + (len(old.slots) if old else 0):
                return False
            if old is not None:
                self._release(namespace, key)
            slots = [self._free.pop() for _ in range(need)]
            runs = self._runs(slots, payload.nbytes)
            src = payload.data
            done = 0
            for offset, length in runs:
                self._pool[offset : offset + length].copy_(src[done : done + length])
                done += length
            self._held[(namespace, key)] = _Held(slots, runs, payload.without_data())
        return True

    def _runs(self, slots: list[int], nbytes: int) -> list[tuple[int, int]]:
        runs: list[tuple[int, int]] = []
        remaining = nbytes
        for slot in slots:
            length = min(self.slot_bytes, remaining)
            offset = slot * self.slot_bytes
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((offset, length))
            remaining -= length
        return runs

    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        with self._lock:
            held = self._held.get((namespace, key))
            if held is None:
                return None
            nbytes = held.payload.nbytes
            if out is None:
                # Pinned like the pool: these bytes are what a restore copies to the device,
                # and only pinned ones go there asynchronously (kvtier.engine.device_copy).
                dest = empty_bytes(nbytes, pin_memory=self.pinned)
            else:
                check_out(out, nbytes)
                dest = out[:nbytes]
            done = 0
            for offset, length in held.runs:
                dest[done : done + length].copy_(self._pool[offset : offset + length])
                done += length
            return held.payload.with_data(dest)

    def _delete(self, key: bytes, namespace: str) -> None:
        with self._lock:
            self._release(namespace, key)

    def _release(self, namespace: str, key: bytes) -> None:
        held = self._held.pop((namespace, key), None)
        if held is not None:
            # Pushed back in reverse so the next put pops them in ascending (adjacent) order.
            self._free.extend(reversed(held.slots))

    def _contains(self, key: bytes, namespace: str) -> bool:
        return (namespace, key) in self._held
