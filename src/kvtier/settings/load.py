"""The effective settings of a command: kvtier.toml, then `KVTIER_<TABLE>__<KEY>` environment
variables, then inline tables (the vLLM connector's `kv_connector_extra_config`), then
`--<table>-set KEY=VALUE`, then dedicated flags; each later source wins, and every value
remembers where it came from.

Each table is validated by its own model (catalog.py says which). An error names the key,
where its value came from and, for a key no table has, the closest valid one, as one
`kvtier: error:` line.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cache.config import TiersConfig
from kvtier.cache.tiers_file import tiers_from_table, unknown_key
from kvtier.errors import KvtierError
from kvtier.policy.config import (
    PolicyConfig,
    env_assignments,
    load_config_traced,
    setting_assignments,
    table_assignments,
)
from kvtier.settings.catalog import ENV_PREFIX, TABLES, keys_of, settings_of
from kvtier.settings.compression import CompressionSection
from kvtier.settings.server import ServerConfig, tenant_from_mapping
from kvtier.toml_table import read_file, setting_value
from kvtier.units import parse_size

CONFIG_ENV = "KVTIER_CONFIG"  # the file when no --config is given
DEFAULT_FILE = "kvtier.toml"  # ... and when that is not set either, if it exists here
FLAT_TABLES = ("tiers", "scheduling", "server", "compression")
DEFAULT_ORIGIN = "default"


@dataclass(frozen=True)
class Settings:
    """What a command runs with. `tiers` is None when every tier is off (device only)."""

    path: str | None  # the config file read, if any
    tiers: TiersConfig | None
    policy: PolicyConfig
    compression: CompressionSection
    # the [scheduling] keys given, as EngineConfig fields (its defaults fill in the rest)
    scheduling: dict[str, Any]
    server: ServerConfig
    # "table.key" -> where its value came from; keys not listed have their default
    origins: dict[str, str] = field(default_factory=dict)
    # the values as given, per flat table ("table.key" -> value), for `kvtier config show`
    given: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_given(self) -> list[str]:
        """The [policy] keys some source gave ("policy.KEY"); none: every default."""
        return [key for key in self.origins if key.startswith("policy.")]

    def warnings(self) -> list[str]:
        """What is configured but will not act, in words a command prints at start."""
        if self.tiers is None and self.policy_given:
            origin = self.origins[self.policy_given[0]]
            return [
                "every tier is off (host_bytes 0, no disk_dir, no remote_url): the engine runs "
                f"on its device pool alone, and the [policy] settings (from {origin}) have "
                "nothing to place KV in"
            ]
        return []

    def origin(self, table: str, key: str) -> str:
        return self.origins.get(f"{table}.{key}", DEFAULT_ORIGIN)


def config_path(given: str | None) -> str | None:
    """The config file: `--config`, else $KVTIER_CONFIG, else ./kvtier.toml when present."""
    path = given or os.environ.get(CONFIG_ENV)
    if path is None and Path(DEFAULT_FILE).is_file():
        path = DEFAULT_FILE
    return path


def load_settings(
    path: str | None,
    *,
    env: Mapping[str, str] | None = None,
    inline: Mapping[str, Mapping[str, Any]] | None = None,
    inline_label: str = "inline",
    sets: Mapping[str, Sequence[str]] | None = None,
    flags: Mapping[str, Mapping[str, Any]] | None = None,
    policy_name: str | None = None,
    engine_tiers: bool = True,
) -> Settings:
    """Merge the sources of every table (see the module doc) and validate each. `sets`:
    table -> its `--<table>-set KEY=VALUE` settings; `flags`: table -> key -> value of its
    dedicated flags (None: not given). `engine_tiers` False leaves `tiers` None, the [tiers]
    values only merged: the simulator models tiers by size, with no folder or URL to check."""
    env = os.environ if env is None else env
    inline, sets, flags = inline or {}, sets or {}, flags or {}
    file_tables = _read_file(path) if path is not None else {}
    values: dict[str, dict[str, Any]] = {name: {} for name in FLAT_TABLES}
    origins: dict[str, str] = {}

    allowed = {table: keys_of(table) for table in FLAT_TABLES}
    allowed["server"].append("tenants")  # [server.tenants.NAME] tables

    def put(table: str, key: str, value: Any, origin: str) -> None:
        if key not in allowed[table]:
            raise KvtierError(f"{table}.{key} (from {origin}): {unknown_key(key, allowed[table])}")
        values[table][key] = value
        origins[f"{table}.{key}"] = origin

    for table in FLAT_TABLES:
        for key, value in file_tables.get(table, {}).items():
            put(table, key, value, str(path))
        prefix = f"{ENV_PREFIX}{table.upper()}__"
        for variable, text in sorted(env.items()):
            if variable.startswith(prefix):
                key = variable.removeprefix(prefix).lower()
                put(table, key, setting_value(text), f"environment variable {variable}")
        for key, value in (inline.get(table) or {}).items():
            put(table, key, value, f"{inline_label}.{table}")
        for setting in sets.get(table, ()):
            key, sep, text = setting.partition("=")
            if not sep or not key.strip():
                raise KvtierError(
                    f"--{table}-set takes KEY=VALUE (e.g. {allowed[table][0]}=...), not {setting!r}"
                )
            put(table, key.strip(), setting_value(text.strip()), f"--{table}-set {setting}")
        for key, value in (flags.get(table) or {}).items():
            if value is not None:
                put(table, key, value, "--" + key.replace("_", "-"))

    policy_flags = [
        ((key,), value, "--" + key.replace("_", "-"))
        for key, value in (flags.get("policy") or {}).items()
        if value is not None
    ]
    named = [] if policy_name is None else [(("name",), policy_name, "--policy")]
    policy, policy_origins = load_config_traced(
        [
            *table_assignments(file_tables.get("policy", {}), str(path)),
            *env_assignments(env),
            # an inline `options` table replaces the file's, as a whole
            *table_assignments(
                inline.get("policy") or {}, f"{inline_label}.policy", whole=("options",)
            ),
            *setting_assignments(sets.get("policy", ())),
            *policy_flags,
            *named,
        ]
    )
    origins.update({f"policy.{key}": origin for key, origin in policy_origins.items()})
    tier_origins = {
        key.removeprefix("tiers."): origin
        for key, origin in origins.items()
        if key.startswith("tiers.")
    }
    return Settings(
        path=path,
        tiers=tiers_from_table(values["tiers"], tier_origins) if engine_tiers else None,
        policy=policy,
        compression=_compression(values["compression"], origins),
        scheduling=_scheduling(values["scheduling"], origins),
        server=_server(values["server"], origins),
        origins=origins,
        given={f"{t}.{k}": v for t, table in values.items() for k, v in table.items()},
    )


def _read_file(path: str) -> dict[str, dict[str, Any]]:
    """The file's tables, each a table this version knows."""
    data = read_file(path)
    for name, table in data.items():
        if name not in TABLES:
            close = difflib.get_close_matches(name, list(TABLES), n=1)
            hint = f"did you mean [{close[0]}]?" if close else f"tables: {', '.join(TABLES)}"
            raise KvtierError(f"{path}: unknown table [{name}]; {hint}")
        if not isinstance(table, dict):
            raise KvtierError(f"{path}: '{name}' must be a table ([{name}]), not {table!r}")
    return data


def _where(table: str, key: str, origins: Mapping[str, str]) -> str:
    origin = origins.get(f"{table}.{key}")
    return f"{table}.{key}" + (f" (from {origin})" if origin else "")


def _scheduling(given: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """The given [scheduling] keys as EngineConfig fields, each checked as EngineConfig
    checks it (an EngineConfig of just that key, the rest default)."""
    from kvtier.engine.config import EngineConfig

    kinds = {row.key: row.doc.kind for row in settings_of("scheduling")}
    checked: dict[str, Any] = {}
    for key, value in given.items():
        where = _where("scheduling", key, origins)
        if kinds[key] == "size" and isinstance(value, str):
            try:
                value = parse_size(value)
            except (KvtierError, ValueError) as exc:
                raise KvtierError(f"{where}: {exc}") from None
        if kinds[key] == "number" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        try:
            EngineConfig(**{key: value})
        except (KvtierError, TypeError) as exc:
            raise KvtierError(f"{where}: {exc}") from None
        checked[key] = value
    return checked


def _server(given: Mapping[str, Any], origins: Mapping[str, str]) -> ServerConfig:
    table = dict(given)
    tenants = table.pop("tenants", {}) or {}
    if not isinstance(tenants, Mapping):
        raise KvtierError(f"{_where('server', 'tenants', origins)}: a table of tables")
    for name, spec in tenants.items():
        if not isinstance(spec, Mapping):
            raise KvtierError(f"server.tenants.{name} must be a table")
    try:
        for key in table:  # one key at a time, so an error names its source
            ServerConfig(**{key: table[key]})
    except (KvtierError, TypeError) as exc:
        raise KvtierError(f"{_where('server', key, origins)}: {exc}") from None
    built = {name: tenant_from_mapping(name, dict(spec)) for name, spec in tenants.items()}
    return ServerConfig(tenants=built, **table)


def _compression(given: Mapping[str, Any], origins: Mapping[str, str]) -> CompressionSection:
    from pydantic import ValidationError

    try:
        return CompressionSection.model_validate(dict(given))
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            # a check of the whole table names the first key given
            key = str(error["loc"][0]) if error["loc"] else next(iter(given), "preset")
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{_where('compression', key, origins)}: {message}")
        raise KvtierError("invalid compression configuration: " + "; ".join(lines)) from None
