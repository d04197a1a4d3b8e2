"""The `[tiers]` table of kvtier.toml -> `TiersConfig`, with command-line overrides.

One loader for every command that runs the engine with tiers. Keys are TiersConfig's own
names, except that the remote tier is `remote_*` (the table names tiers, not products) and the
master key comes from a file::

    [tiers]
    host_bytes = "8GiB"            # sizes: bytes, or "512MiB", "8GiB", "1TB"; 0 turns it off
    disk_dir = "kv-cache"          # a persistent disk tier (survives restarts); relative
                                   # paths are taken from the directory kvtier runs in
    disk_bytes = "100GiB"
    remote_url = "redis://cache:6379/0"
    remote_bytes = "8GiB"          # this replica's own writes; the global bound is Redis's
    remote_cluster = false         # true: a Redis Cluster (remote_url names one node)
    encrypt = true                 # seal disk and remote records (AES-GCM)
    encrypt_key_file = "keys/master.key"
    create_key = true              # write a fresh key there on first start (mode 0600)
    chunk_tokens = 256
    write_through = false          # true: every finished turn's chunks; "selective": reused ones

Without `host_bytes` the host tier is sized from the machine (`default_host_bytes`); the disk
and remote tiers are off unless a directory or URL is given. Errors name the key and where
its value came from (`tiers.disk_bytes (from --tiers-set disk_bytes=x): ...`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvtier.cache.config import TiersConfig
from kvtier.errors import KvtierError
from kvtier.toml_table import read_table, setting_value

# table key -> TiersConfig field, where they differ
_RENAMED = {
    "remote_url": "redis_url",
    "remote_bytes": "redis_bytes",
    "remote_prefix": "redis_prefix",
    "remote_timeout_s": "redis_timeout_s",
    "remote_cluster": "redis_cluster",
}
# fields the table cannot set: computed, or given some other way
_NOT_IN_TABLE = {"cost_profile", "encrypt_key", "disk_persist", *_RENAMED.values()}
_SIZES = {"host_bytes", "disk_bytes", "remote_bytes"}
_KEY_FILE = ("encrypt_key_file", "create_key")
_GIB = 1 << 30


def table_keys() -> list[str]:
    """Every key the [tiers] table accepts."""
    own = [f.name for f in fields(TiersConfig) if f.name not in _NOT_IN_TABLE]
    return sorted([*own, *_RENAMED, *_KEY_FILE])


def load_tiers(
    path: str | Path | None,
    *,
    settings: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
) -> TiersConfig | None:
    """The file's [tiers] table, then `settings` (`KEY=VALUE`, from --tiers-set), then
    `overrides` (table key -> value, from dedicated flags; None values are left out), each
    later source winning. None when every tier is off (device only)."""
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    if path is not None:
        for key, value in read_table(path, "tiers").items():
            merged[key], source[key] = value, str(path)
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key.strip():
            raise KvtierError(
                f"--tiers-set takes KEY=VALUE (e.g. chunk_tokens=64), not {setting!r}"
            )
        key = key.strip()
        merged[key], source[key] = setting_value(text.strip()), f"--tiers-set {setting}"
    for key, value in (overrides or {}).items():
        if value is not None:
            merged[key], source[key] = value, "--" + key.replace("_", "-")
    return build_tiers(merged, source)


def build_tiers(
    table: Mapping[str, Any], source: Mapping[str, str] | None = None
) -> TiersConfig | None:
    """A TiersConfig from table keys and values (None: every tier off)."""
    source = source or {}

    def where(key: str) -> str:
        return f"tiers.{key}" + (f" (from {source[key]})" if key in source else "")

    unknown = sorted(set(table) - set(table_keys()))
    if unknown:
        raise KvtierError(f"{where(unknown[0])}: unknown key; allowed: {', '.join(table_keys())}")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in _KEY_FILE:
            continue
        if key in _SIZES:
            value = _size(value, where(key))
        values[_RENAMED.get(key, key)] = value
    if "host_bytes" not in values:
        values["host_bytes"] = default_host_bytes()
    disk_dir = values.get("disk_dir")
    if disk_dir is not None:
        if not isinstance(disk_dir, str | Path) or not str(disk_dir):
            raise KvtierError(f"{where('disk_dir')}: a folder path, got {disk_dir!r}")
        values.setdefault("disk_bytes", default_disk_bytes(Path(disk_dir)))
        # a configured disk tier keeps its chunks across restarts (where its backend can)
        values["disk_persist"] = values.get("disk_backend", "segments") == "segments"
    elif values.get("disk_bytes"):
        raise KvtierError(f"{where('disk_bytes')}: needs tiers.disk_dir (--disk-dir)")
    key_file = table.get("encrypt_key_file")
    if key_file is not None:
        from kvtier.tiers.keyfile import read_key_file

        create = table.get("create_key", False)
        if not isinstance(create, bool):
            raise KvtierError(f"{where('create_key')}: true or false, got {create!r}")
        values["encrypt_key"] = read_key_file(key_file, create=create)
    elif table.get("create_key"):
        raise KvtierError(f"{where('create_key')}: needs tiers.encrypt_key_file")
    if values.get("encrypt") and "encrypt_key" not in values:
        raise KvtierError(
            f"{where('encrypt')}: needs tiers.encrypt_key_file (--encrypt-key-file); a "
            "random per-process key would make every chunk unreadable after a restart"
        )
    if not (values["host_bytes"] or values.get("disk_bytes") or values.get("redis_url")):
        return None
    try:
        return TiersConfig(**values)
    except TypeError as exc:  # a value of the wrong type inside TiersConfig's checks
        raise KvtierError(f"invalid [tiers] value: {exc}") from None


def default_host_bytes() -> int:
    """A tenth of the machine's memory, at most half of what is free now, whole MiB: the host
    tier is preallocated at start, so it must leave room for the model and everything else."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return _GIB
    return max(0, min(total // 10, free // 2)) & ~((1 << 20) - 1)


def default_disk_bytes(directory: Path) -> int:
    """Half the free space of the folder's filesystem, at most 64 GiB."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = os.statvfs(probe)
    except OSError as exc:
        raise KvtierError(f"tiers.disk_dir {directory}: {exc.strerror or exc}") from None
    return min(64 * _GIB, usage.f_bavail * usage.f_frsize // 2)


def _size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise KvtierError(f"{where}: a size in bytes or like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise KvtierError(f"{where}: must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        if value.strip() == "0":
            return 0
        from kvtier.plan.units import parse_size

        try:
            return parse_size(value)
        except (KvtierError, ValueError) as exc:
            raise KvtierError(f"{where}: {exc}") from None
    raise KvtierError(f"{where}: a size in bytes or like '8GiB', got {value!r}")
