"""One table of kvtier.toml, and one `KEY=VALUE` setting's value: read the same way by every
section loader (`[policy]`, `[compression]`, `[tiers]`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError


def read_file(path: str | Path) -> dict[str, Any]:
    """The whole file, parsed; a missing or malformed file is one clear error."""
    try:
        with Path(path).open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise KvtierError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise KvtierError(f"config file {path} is not valid TOML: {exc}") from None


def read_table(path: str | Path, name: str) -> dict[str, Any]:
    """The file's `[name]` table ({} when it has none)."""
    table = read_file(path).get(name, {})
    if not isinstance(table, dict):
        raise KvtierError(f"{path}: '{name}' must be a table ([{name}]), not {table!r}")
    return table


def setting_value(text: str) -> Any:
    """A TOML value if the text is one (10, 2.5, true, {disk = "int8"}), else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
