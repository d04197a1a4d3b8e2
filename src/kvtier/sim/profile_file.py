"""Write a hardware profile as a TOML file that `load_profile` reads back unchanged.

Profiles hold scalars, a list of strings and tables one or two levels deep (`[accelerator]`,
`[links.host]`), so a small writer covers them; strings are JSON-quoted, which TOML's basic
strings accept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.sim.profile import HardwareProfile, validate_profile


def profile_toml(profile: HardwareProfile, comments: Sequence[str] = ()) -> str:
    """The profile as TOML, `comments` first (one `#` line each)."""
    data = profile.model_dump(exclude_none=True)
    lines = [f"# {line}" if line else "#" for line in comments]
    tables: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_value(value)}")
    while tables:
        name, table = tables.pop(0)
        scalars = {k: v for k, v in table.items() if not isinstance(v, Mapping)}
        if scalars or not table:
            lines += ["", f"[{name}]"] + [f"{k} = {_value(v)}" for k, v in scalars.items()]
        tables[:0] = [(f"{name}.{k}", v) for k, v in table.items() if isinstance(v, Mapping)]
    return "\n".join(lines) + "\n"


def write_profile(profile: HardwareProfile, path: Path, comments: Sequence[str] = ()) -> Path:
    """Write the profile to `path` (folders created) and check it reads back the same."""
    text = profile_toml(profile, comments)
    import tomllib

    if validate_profile(tomllib.loads(text), str(path)) != profile:
        raise KvtierError(f"profile {profile.name} does not survive a TOML round trip")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise KvtierError(f"cannot write the profile to {path}: {exc}") from None
    return path


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        if not value:
            return "[]"
        return "[\n" + "".join(f"  {_value(v)},\n" for v in value) + "]"
    raise KvtierError(f"cannot write {value!r} to a profile file")
