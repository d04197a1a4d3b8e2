"""A tier that holds sizes, not bytes: what the simulator puts under the same store.

It takes the same calls and keeps the same counters and budget as a real tier, so a simulated
run exercises the store's placement, eviction and accounting code unchanged; `get` returns a
payload with the stored size and form and no data. Time is the simulator's business (its cost
model prices each operation from the bytes the counters report).
"""

from __future__ import annotations

import threading

import torch

from kvtier.tiers.base import TierBackend
from kvtier.tiers.payload import Payload


class SizeOnlyTier(TierBackend):
    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name)
        self._capacity = capacity_bytes
        self._held: dict[tuple[str, bytes], Payload] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def _put(self, key: bytes, payload: Payload, namespace: str) -> bool:
        with self._lock:
            old = self._held.get((namespace, key))
            freed = old.nbytes if old is not None else 0
            if self._used - freed + payload.nbytes > self._capacity:
                return False
            self._held[(namespace, key)] = payload.without_data()
            self._used += payload.nbytes - freed
        return True

    def _get(self, key: bytes, namespace: str, out: torch.Tensor | None) -> Payload | None:
        return self._held.get((namespace, key))

    def _delete(self, key: bytes, namespace: str) -> None:
        with self._lock:
            old = self._held.pop((namespace, key), None)
            if old is not None:
                self._used -= old.nbytes

    def _contains(self, key: bytes, namespace: str) -> bool:
        return (namespace, key) in self._held
