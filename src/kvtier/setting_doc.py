"""What a setting says about itself: the one line of help, the kind of value, a default given
in words where it is computed, and whether every command taking its table has a flag for it.

A typed model (TiersConfig, EngineConfig, ServerConfig: dataclasses; PolicyConfig: pydantic)
attaches a `SettingDoc` to each field that is a setting, through `setting()` (dataclasses) or
`json_schema_extra` (pydantic). `kvtier.settings` reads these to build flags, environment
variables, `kvtier config show` and the reference page, so a key is defined once: its name,
type and default in the model, its words here. A field without one is not a setting (it is
computed, or handed over by code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from kvtier.errors import KvtierError

META_KEY = "setting"


@dataclass(frozen=True)
class SettingDoc:
    help: str
    # the value's kind, as a user writes it: size (bytes, or "8GiB"), int, number, bool,
    # string, path, table, list; with `choices`, one of them
    kind: str
    default_text: str | None = None  # a computed default, said in words
    flag: bool = False  # a dedicated --flag in every command that reads the table
    choices: tuple[str, ...] = ()
    key: str | None = None  # the table key, where it differs from the field's name


def setting(
    default: Any = MISSING,
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    help: str,
    kind: str,
    default_text: str | None = None,
    flag: bool = False,
    choices: tuple[str, ...] = (),
    key: str | None = None,
) -> Any:
    """A dataclass field that is a setting."""
    doc = SettingDoc(help, kind, default_text, flag, choices, key)
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={META_KEY: doc})
    return field(default=default, metadata={META_KEY: doc})


def pydantic_extra(
    *,
    help: str,
    kind: str,
    default_text: str | None = None,
    flag: bool = False,
    choices: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`json_schema_extra` of a pydantic field that is a setting."""
    return {META_KEY: SettingDoc(help, kind, default_text, flag, choices)}


def setting_fields(model: Any) -> list[tuple[Field[Any], SettingDoc]]:
    """A dataclass's fields that are settings, each with its words, in declaration order."""
    return [(item, item.metadata[META_KEY]) for item in fields(model) if META_KEY in item.metadata]


def check_choices(model: Any, table: str) -> None:
    """Each setting of a dataclass that names its choices holds one of them (or None, where
    None is its default): the choices `--help` and the reference show are the ones checked."""
    for item, doc in setting_fields(model):
        if not doc.choices:
            continue
        value = getattr(model, item.name)
        if value in doc.choices or (value is None and item.default is None):
            continue
        allowed = " or ".join(filter(None, (", ".join(doc.choices[:-1]), doc.choices[-1])))
        raise KvtierError(f"{table}.{doc.key or item.name} must be {allowed}, got {value!r}")
