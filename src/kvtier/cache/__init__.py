"""Tiered KV for the engine: device blocks demoted to host / disk / remote and restored.

See docs/tiers.md. `build_engine(EngineConfig(...), CacheConfig(TiersConfig(...), policy))`
gives an engine a `TieredConnector` (the engine's connector contract: loads into the blocks
the scheduler allocates, spills, prefetch) and a `PolicyRunner` (the retention policy on the
engine clock and under memory pressure).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use (PEP 562): importing one light module of the package (its
# settings, say) must not load torch and every backend with it.
_EXPORTS = {
    "CacheConfig": "kvtier.cache.setup",
    "TieredConnector": "kvtier.cache.connector",
    "TiersConfig": "kvtier.cache.config",
    "attach_connector": "kvtier.cache.setup",
    "build_engine": "kvtier.cache.setup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
