"""`kvtier config show`: the effective settings, table by table, each value with where it came
from (the file, an environment variable, a flag, or the default)."""

from __future__ import annotations

from typing import Any

from kvtier.settings.catalog import TABLES, Setting, settings_of, size_text, toml_text
from kvtier.settings.load import DEFAULT_ORIGIN, Settings


def render(settings: Settings) -> str:
    lines = [f"# effective settings; file: {settings.path or 'none'}"]
    for table in TABLES:
        lines += ["", f"[{table}]"]
        if table == "tiers" and settings.tiers is None:
            lines.append("# every tier is off: the engine runs on its device pool alone")
        rows = [
            (f"{row.key} = {_value(settings, row)}", _comment(settings, row))
            for row in settings_of(table)
        ]
        width = min(48, max(len(text) for text, _ in rows))
        lines += [f"{text:<{width}}  # {comment}" for text, comment in rows]
    return "\n".join(lines)


def _comment(settings: Settings, row: Setting) -> str:
    origin = settings.origin(row.table, row.key)
    if origin == DEFAULT_ORIGIN and row.doc.default_text is not None:
        return f"{origin}: {row.doc.default_text}"
    return origin


def _value(settings: Settings, row: Setting) -> str:
    table, origin = row.table, settings.origin(row.table, row.key)
    if table == "policy":
        value: Any = settings.policy
        for part in row.key.split("."):
            value = getattr(value, part)
    elif table == "compression":
        value = getattr(settings.compression, row.key)
    elif table == "server":
        value = getattr(settings.server, row.field)
    elif table == "scheduling":
        value = settings.scheduling.get(row.key, row.default)
    else:  # tiers
        if settings.tiers is None or not hasattr(settings.tiers, row.field):
            given = settings.given.get(f"tiers.{row.key}")
            return toml_text(given if origin != DEFAULT_ORIGIN else row.default)
        value = getattr(settings.tiers, row.field)
        if row.key == "encrypt_key_file":
            value = settings.given.get("tiers.encrypt_key_file")
    if row.doc.kind == "size" and isinstance(value, int) and value:
        return size_text(value)
    return toml_text(value)
