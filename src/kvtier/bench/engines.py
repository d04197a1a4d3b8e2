"""One fresh Engine per policy: same model, pool, tiers and concurrency; only the policy changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.cache.config import TiersConfig
    from kvtier.clock import Clock
    from kvtier.engine.engine import Engine
    from kvtier.policy.cost_model import CostProfile
    from kvtier.workload.model import Request


def validate_policies(names: Sequence[str]) -> None:
    """Unknown policy names fail before any model is loaded."""
    from kvtier.policy.registry import resolve_policy

    for name in names:
        resolve_policy(name)


def build(
    base: Mapping[str, Any],
    policy: str,
    tiers: TiersConfig | None,
    arrivals: Mapping[str, Sequence[float]],
    policy_config: Any = None,
    clock: Clock | None = None,
) -> Engine:
    """The engine of one run. `oracle` needs the future, so the registry refuses to build it
    from configuration: it is built here as `OraclePolicy(arrivals)` and handed over as a
    policy object (`arrivals` is updated in place as the replay learns the real send times of
    closed-loop turns)."""
    from kvtier.cache.setup import CacheConfig, build_engine
    from kvtier.engine.config import EngineConfig

    chosen: Any = policy
    if policy == "oracle":
        from kvtier.policy.oracle import OraclePolicy

        if tiers is None:
            raise KvtierError("the oracle policy needs tiers (give --host-bytes)")
        chosen = OraclePolicy(arrivals)
    cache = None if tiers is None else CacheConfig(tiers, chosen, policy_config)
    return build_engine(EngineConfig(**base), cache, clock)


@dataclass(frozen=True)
class Measured:
    profile: CostProfile
    # what the run's engines run, "auto" decided on this host (the results' `host.engine`)
    dtype: str
    prefill_attention: str


def check_and_measure(
    base: Mapping[str, Any], requests: Sequence[Request], max_output_tokens: int | None
) -> Measured:
    """On an engine of the run's settings without tiers: check that every request fits
    (`fit.py`, before any policy runs), then measure what its prefills cost (`profile.py`).
    A pool too small for the measuring prefills is measured on an engine like it with a pool
    that holds them: a prefill's time does not depend on the pool's size."""
    from kvtier.bench.fit import check_fits
    from kvtier.bench.profile import PROFILE_TOKENS, measure_profile
    from kvtier.cache.setup import build_engine
    from kvtier.engine.config import EngineConfig

    engine = build_engine(EngineConfig(**base))
    ran = engine.config
    try:
        check_fits(engine, requests, max_output_tokens)
        pool = engine.kv_pool
        blocks = -(-PROFILE_TOKENS // pool.block_size)
        if pool.num_blocks >= blocks:
            return Measured(measure_profile(engine), ran.dtype, ran.prefill_attention)
        needed = blocks * pool.bytes_per_block
    finally:
        engine.close()
    engine = build_engine(EngineConfig(**{**base, "kv_cache_bytes": needed}))
    try:
        return Measured(measure_profile(engine), ran.dtype, ran.prefill_attention)
    finally:
        engine.close()
