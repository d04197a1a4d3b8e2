"""Tiered KV for the engine: device blocks demoted to host / disk / remote and restored.

See docs/tiers.md. `build_engine(EngineConfig(...), CacheConfig(TiersConfig(...), policy))`
gives an engine a `TieredConnector` (the engine's connector contract: loads into the blocks
the scheduler allocates, spills, prefetch) and a `PolicyRunner` (the retention policy on the
engine clock and under memory pressure).
"""

from __future__ import annotations

from kvtier.lazy_exports import lazy_getattr

_EXPORTS = {
    "CacheConfig": "kvtier.cache.setup",
    "TieredConnector": "kvtier.cache.connector",
    "TiersConfig": "kvtier.cache.config",
    "attach_connector": "kvtier.cache.setup",
    "build_engine": "kvtier.cache.setup",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
