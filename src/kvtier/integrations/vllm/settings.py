"""The connector's settings from vLLM's `kv_connector_extra_config`.

The same [tiers] and [policy] tables `kvtier serve` reads, from a kvtier.toml (`"config"`)
and/or inline (`"tiers"`, `"policy"`: table key -> value, inline winning), so a deployment
moves between kvtier's own server and vLLM with one file. vLLM only learns which blocks
kvtier can fill, so two tier settings are fixed here: a finished request's full chunks are
written through to the top tier (the only moment the connector sees a sequence's blocks
whole), and nothing is spilled on eviction (vLLM evicts without telling a connector).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.cache.config import TiersConfig
from kvtier.errors import KvtierError
from kvtier.policy.config import PolicyConfig
from kvtier.settings.load import load_settings
from kvtier.units import format_bytes

KNOWN_KEYS = ("config", "tiers", "policy", "namespace")


@dataclass(frozen=True)
class ConnectorSettings:
    tiers: TiersConfig
    policy: PolicyConfig
    namespace: str | None  # the block-key namespace; None: vLLM's model name


def parse_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(KNOWN_KEYS))
    if unknown:
        raise KvtierError(
            f"kv_connector_extra_config: unknown key {unknown[0]!r}; allowed: "
            + ", ".join(KNOWN_KEYS)
        )
    settings = load_settings(
        extra.get("config"),
        inline={name: _table(extra, name) for name in ("tiers", "policy")},
        inline_label="kv_connector_extra_config",
    )
    if settings.tiers is None:
        raise KvtierError(
            "kv_connector_extra_config: every tier is off (host_bytes 0, no disk_dir, no "
            "remote_url): the kvtier connector would have nowhere to keep KV"
        )
    tiers = dataclasses.replace(settings.tiers, write_through=True, spill_on_evict=True)
    namespace = extra.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise KvtierError(f"kv_connector_extra_config.namespace: a string, got {namespace!r}")
    return ConnectorSettings(tiers, settings.policy, namespace)


def _table(extra: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = extra.get(name) or {}
    if not isinstance(table, Mapping):
        raise KvtierError(f"kv_connector_extra_config.{name}: a table (dict), got {table!r}")
    return dict(table)


def describe(settings: ConnectorSettings, load_failure_policy: str) -> str:
    """The connector's effective settings in one log line."""
    tiers = settings.tiers
    placed = [f"host {format_bytes(tiers.host_bytes)}"] if tiers.host_bytes else []
    if tiers.disk_dir is not None and tiers.disk_bytes:
        placed.append(f"disk {format_bytes(tiers.disk_bytes)} in {tiers.disk_dir}")
    if tiers.redis_url:
        placed.append(f"remote {format_bytes(tiers.redis_bytes)} at {tiers.redis_url}")
    forms = {tier: form for tier, form in tiers.tier_forms().items() if form != "full"}
    return (
        f"tiers {', '.join(placed)}; chunks of {tiers.chunk_tokens} tokens, written through"
        + (f", forms {forms}" if forms else "")
        + f"; policy {settings.policy.name} every {settings.policy.interval_s:g} s"
        + f"; kv_load_failure_policy={load_failure_policy}"
    )
