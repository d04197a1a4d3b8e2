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
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.cache.config import TiersConfig
from kvtier.cache.tiers_file import load_tiers
from kvtier.errors import KvtierError
from kvtier.policy.config import PolicyConfig, load_config

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
    path = extra.get("config")
    tiers_table = _table(extra, "tiers")
    policy_table = _table(extra, "policy")
    tiers = load_tiers(path, overrides=tiers_table)
    if tiers is None:
        raise KvtierError(
            "kv_connector_extra_config: every tier is off (host_bytes 0, no disk_dir, no "
            "redis_url): the kvtier connector would have nowhere to keep KV"
        )
    tiers = dataclasses.replace(tiers, write_through=True, spill_on_evict=True)
    settings = [f"{key}={_toml(value)}" for key, value in _flatten(policy_table)]
    policy = load_config(path, settings=settings)
    namespace = extra.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise KvtierError(f"kv_connector_extra_config.namespace: a string, got {namespace!r}")
    return ConnectorSettings(tiers, policy, namespace)


def _table(extra: Mapping[str, Any], name: str) -> dict[str, Any]:
    table = extra.get(name) or {}
    if not isinstance(table, Mapping):
        raise KvtierError(f"kv_connector_extra_config.{name}: a table (dict), got {table!r}")
    return dict(table)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, Mapping) and key != "options":
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((prefix + key, value))
    return items


def _toml(value: Any) -> str:
    """A value as the TOML text `load_config` parses back (JSON scalars are TOML too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
