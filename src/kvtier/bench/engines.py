"""One fresh Engine per policy: same model, pool, tiers and concurrency; only the policy changes.

The retention policy and the tiers live in the engine (`EngineConfig.policy`, `.tiers`,
`kvtier.cache`). Until the engine has them, a plain engine is the `retain` policy (KV stays
on the device until the pool's LRU evicts it) and the other policies are reported as
unavailable instead of silently running as `retain`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.engine.config import EngineConfig

PLAIN_POLICY = "retain"  # what an engine without kvtier.cache does


def tiered_engine_available() -> bool:
    """True once the engine integrates the tiered store and retention policies."""
    from kvtier.engine.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {"policy", "tiers"} <= names and importlib.util.find_spec("kvtier.cache") is not None


def unavailable_policies(names: Sequence[str]) -> dict[str, str]:
    """Policies this engine cannot run, with the reason (empty when all can)."""
    if tiered_engine_available():
        return {}
    reason = "the engine has no tiered store / retention policies yet (kvtier.cache)"
    return {name: reason for name in names if name != PLAIN_POLICY}


def validate_policies(names: Sequence[str]) -> None:
    """Unknown policy names fail before any model is loaded."""
    from kvtier.policy.registry import resolve_policy

    for name in names:
        resolve_policy(name)


def tiers_config(host_bytes: int, disk_bytes: int, disk_dir: str | None) -> Any:
    """The engine's tier settings (kvtier.cache.config.TiersConfig; None: device only)."""
    if not tiered_engine_available() or (host_bytes <= 0 and disk_bytes <= 0):
        return None
    from kvtier.cache.config import TiersConfig

    if disk_bytes and not disk_dir:
        raise KvtierError("--disk-bytes needs --disk-path (the disk tier's folder)")
    return TiersConfig(host_bytes=host_bytes, disk_bytes=disk_bytes, disk_dir=disk_dir)


def engine_config(
    base: Mapping[str, Any],
    policy: str,
    tiers: Any,
    arrivals: Mapping[str, Sequence[float]],
    policy_config: Any = None,
) -> tuple[EngineConfig, Any]:
    """(EngineConfig, the oracle policy to install or None) for one run.

    `oracle` needs the future: it is built here as OraclePolicy(arrivals) (the registry
    refuses to build it from configuration) and installed by `build_engine`."""
    from kvtier.engine.config import EngineConfig

    values = dict(base)
    oracle = None
    if tiered_engine_available():
        values["tiers"] = tiers
        values["policy"] = policy
        if policy_config is not None:
            values["policy_config"] = policy_config
        if policy == "oracle":
            from kvtier.policy.oracle import OraclePolicy

            oracle = OraclePolicy(arrivals)
    elif policy != PLAIN_POLICY:
        raise KvtierError(f"policy {policy!r} needs the tiered engine (kvtier.cache)")
    return EngineConfig(**values), oracle


def build_engine(config: EngineConfig, oracle: Any, clock: Any) -> Any:
    """A fresh Engine on `clock`, with the oracle installed in its policy runner.

    The registry cannot build the oracle from configuration (it needs the future), so the
    engine is built with `offload` (same cascade-on-evict behaviour) and its runner's policy
    is replaced."""
    from dataclasses import replace

    from kvtier.engine.engine import Engine

    if oracle is None:
        return Engine(config, clock=clock)
    engine = Engine(replace(config, policy="offload"), clock=clock)
    runner = getattr(engine.connector, "runner", None)
    if runner is None:
        engine.close()
        raise KvtierError("the oracle policy needs tiers (give --host-bytes)")
    runner.policy = oracle
    runner.policy_name = "oracle"
    runner.config = runner.config.model_copy(update={"name": "oracle"})
    engine.config.policy = "oracle"
    return engine
