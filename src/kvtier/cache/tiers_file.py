"""The `[tiers]` table -> `TiersConfig`: sizes parsed, the disk tier's defaults taken from its
filesystem, the master key read from its file. `kvtier.settings` merges the table's sources
(file, environment, flags) and calls `tiers_from_table`. Keys are TiersConfig's settings (their
`key` where it differs: the remote tier is `remote_*`, the table names tiers, not products),
and the master key comes from a file::

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

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.cache.config import TiersConfig, default_host_bytes
from kvtier.errors import KvtierError
from kvtier.setting_doc import SettingDoc, setting_fields

# Keys of the table that are no TiersConfig field: the master key comes from a file.
KEY_FILE_SETTINGS = {
    "encrypt_key_file": SettingDoc(
        "the master key file (64 hex digits, mode 0600); without `encrypt`, signs Redis values",
        "path",
        default_text="none",
        flag=True,
    ),
    "create_key": SettingDoc(
        "write a fresh key to `encrypt_key_file` when it is missing", "bool", flag=True
    ),
}
_GIB = 1 << 30


def _settings() -> dict[str, tuple[str, SettingDoc]]:
    """[tiers] key -> (TiersConfig field, its words), for the fields that are settings."""
    return {doc.key or item.name: (item.name, doc) for item, doc in setting_fields(TiersConfig)}


def table_keys() -> list[str]:
    """Every key the [tiers] table accepts."""
    return sorted([*_settings(), *KEY_FILE_SETTINGS])


def tiers_from_table(
    table: Mapping[str, Any], source: Mapping[str, str] | None = None
) -> TiersConfig | None:
    """A TiersConfig from table keys and values (None: every tier off)."""
    source = source or {}

    def where(key: str) -> str:
        return f"tiers.{key}" + (f" (from {source[key]})" if key in source else "")

    allowed = table_keys()
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise KvtierError(f"{where(unknown[0])}: {unknown_key(unknown[0], allowed)}")
    settings = _settings()
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in KEY_FILE_SETTINGS:
            continue
        name, doc = settings[key]
        values[name] = _size(value, where(key)) if doc.kind == "size" else value
    if "host_bytes" not in values:
        values["host_bytes"] = default_host_bytes()  # the field's default, taken now
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


def unknown_key(key: str, allowed: Sequence[str]) -> str:
    """The message for a key no table has: the closest valid one, or the list."""
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f"unknown key; did you mean {close[0]}?"
    return f"unknown key; allowed: {', '.join(allowed)}"


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
        from kvtier.units import parse_size

        try:
            return parse_size(value)
        except (KvtierError, ValueError) as exc:
            raise KvtierError(f"{where}: {exc}") from None
    raise KvtierError(f"{where}: a size in bytes or like '8GiB', got {value!r}")
