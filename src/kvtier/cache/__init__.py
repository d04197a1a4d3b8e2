"""Tiered KV for the engine: device blocks demoted to host / disk / remote and restored.

See docs/cache.md. `TiersConfig` goes into `EngineConfig.tiers`; the engine then builds a
`TieredConnector` (block events, prefix restore, prefetch) and a `PolicyRunner` (the
retention policy on the engine clock and under memory pressure).
"""

from kvtier.cache.config import TiersConfig

__all__ = ["TiersConfig"]
