"""Engine + tiers + retention policy, put together: the one way commands build a serving stack.

`EngineConfig` describes the engine alone; `CacheConfig` is the tier layer's own settings
(tiers, policy and its configuration), read from kvtier.toml by `kvtier.settings`.
`build_engine` is what `kvtier bench`, `serve`, `eval` and the benchmarks call;
`attach_connector` swaps the tiers of a loaded engine (benchmarks and tests compare setups on
one model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache.config import TiersConfig
from kvtier.cache.connector import TieredConnector
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.lowrank.bases import with_fitted_bases
from kvtier.models import EMBEDDED_MODEL_NAME

if TYPE_CHECKING:
    from kvtier.clock import Clock
    from kvtier.policy.base import RetentionPolicy
    from kvtier.policy.config import PolicyConfig


@dataclass
class CacheConfig:
    """Tiers under the device pool and the retention policy that places KV among them.

    `policy` names a registered policy, or is a ready-built `RetentionPolicy` (one that
    cannot be built from configuration, such as the oracle, which needs the future);
    `policy_config` overrides its settings (its `name` is replaced)."""

    tiers: TiersConfig
    policy: str | RetentionPolicy = "retain"
    policy_config: PolicyConfig | None = None

    def connector(self) -> TieredConnector:
        return TieredConnector(self.tiers, self.policy, self.policy_config)


def build_engine(
    config: EngineConfig | None = None,
    cache: CacheConfig | None = None,
    clock: Clock | None = None,
) -> Engine:
    """An engine, with a tiered connector when `cache` is given (None: device only). A
    low-rank press in the compression pipeline gets its basis first (fitted once and cached
    on disk: `kvtier.lowrank.bases`)."""
    config = config or EngineConfig()
    if config.compression is not None:
        config = dataclasses.replace(config, compression=with_fitted_bases(config.compression))
    if cache is not None and cache.policy_config is not None:
        # the accuracy figures that let the policy store lossy forms are the served model's
        model = config.model_dir or EMBEDDED_MODEL_NAME
        cache = dataclasses.replace(cache, policy_config=cache.policy_config.for_model(model))
    return Engine(config, clock=clock, connector=None if cache is None else cache.connector())


def attach_connector(
    engine: Engine,
    tiers: TiersConfig | None,
    policy: str | RetentionPolicy = "retain",
    policy_config: PolicyConfig | None = None,
) -> TieredConnector | None:
    """Give an idle engine a fresh connector over `tiers` (None: device only), replacing the
    one it has; its prefix cache is reset first (`Engine.set_connector`)."""
    connector = None if tiers is None else TieredConnector(tiers, policy, policy_config)
    engine.set_connector(connector)
    return connector
