"""Tiered KV for the engine: device blocks demoted to host / disk / remote and restored.

See docs/tiers.md. `build_engine(EngineConfig(...), CacheConfig(TiersConfig(...), policy))`
gives an engine a `TieredConnector` (the engine's connector contract: loads into the blocks
the scheduler allocates, spills, prefetch) and a `PolicyRunner` (the retention policy on the
engine clock and under memory pressure).
"""

from kvtier.cache.config import TiersConfig
from kvtier.cache.connector import TieredConnector
from kvtier.cache.setup import CacheConfig, attach_connector, build_engine

__all__ = ["CacheConfig", "TieredConnector", "TiersConfig", "attach_connector", "build_engine"]
