"""What one request allows a restore to load: which tiers, and how many tokens at most.

A client that knows better than the cache (a latency-critical request that must not wait on
a remote read, a benchmark that measures one tier) says so per request, in the words vLLM's
offloading connector uses in `kv_transfer_params`: `kv_load_tiers` (tier names; an empty list
loads nothing) and `max_load_tokens`. A chunk in a tier the request does not allow is treated
as stored nowhere: it is recomputed. The engine's request carries a `LoadLimit`; the restorer
reads it when it plans the request's loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadLimit:
    tiers: frozenset[str] | None = None  # None: every tier
    max_tokens: int | None = None  # None: no cap

    def allows(self, tier: str | None) -> bool:
        return self.tiers is None or tier in self.tiers

    @property
    def empty(self) -> bool:
        return self.tiers is None and self.max_tokens is None


NO_LOAD_LIMIT = LoadLimit()
