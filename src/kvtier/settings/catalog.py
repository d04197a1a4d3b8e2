"""Every table of kvtier.toml and every key in it, read off the typed models that define them.

The models own the keys: their names, types and defaults (cache.config.TiersConfig,
engine.config.EngineConfig for `[scheduling]`, server.config.ServerConfig, and the pydantic
PolicyConfig and CompressionSection). This module only lists them, with the words each
field carries (`kvtier.setting_doc`), for the loader, the flags, `kvtier config show` and the
reference page. Adding a setting is a field and its test: nothing here changes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.cache.tiers_file import KEY_FILE_SETTINGS
from kvtier.setting_doc import META_KEY, SettingDoc, setting_fields

ENV_PREFIX = "KVTIER_"


@dataclass(frozen=True)
class Setting:
    """One key of one table."""

    table: str
    key: str  # dotted below the table for nested policy keys: cost.horizon_s
    field: str  # the model's attribute
    doc: SettingDoc
    default: Any  # the model's default value (None: none, or computed: see doc.default_text)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-").replace(".", "-")

    @property
    def default_words(self) -> str:
        """The default as the reference and `kvtier config show` state it."""
        if self.doc.default_text is not None:
            return self.doc.default_text
        if self.doc.kind == "size" and self.default:
            return size_text(self.default)
        return toml_text(self.default)


@dataclass(frozen=True)
class Table:
    name: str
    what: str
    read_by: str
    # "module:Class", imported on use: the policy's model pulls in its numba kernels, which
    # building a command's flags must not wait for
    model_path: str

    def model(self) -> type:
        module, _, name = self.model_path.partition(":")
        return getattr(importlib.import_module(module), name)


TABLES: dict[str, Table] = {
    table.name: table
    for table in (
        Table(
            "tiers",
            "tier budgets, disk folder, Redis URL, chunk size, forms, integrity, "
            "write-through, restore",
            "`kvtier serve`, `bench`, `simulate` (the budgets, chunk size, write-through and "
            "kept blocks), `config show`, the vLLM connector",
            "kvtier.cache.config:TiersConfig",
        ),
        Table(
            "policy",
            "the retention policy, its prices, predictor and cost profile",
            "`kvtier serve`, `bench`, `simulate`, `config show`, the vLLM connector",
            "kvtier.policy.config:PolicyConfig",
        ),
        Table(
            "compression",
            "the KV compression pipeline",
            "`kvtier serve`, `bench`, `config show`",
            "kvtier.settings.compression:CompressionSection",
        ),
        Table(
            "scheduling",
            "the device KV pool, the batch and the running set, what counts as resumed",
            "`kvtier serve`, `bench`, `simulate`, `config show`, `calibrate` (`prefill_attention`, "
            "`deterministic`)",
            "kvtier.engine.config:EngineConfig",
        ),
        Table(
            "server",
            "model id, tenants, API keys, limits, connections",
            "`kvtier serve`, `config show`",
            "kvtier.settings.server:ServerConfig",
        ),
    )
}


def settings_of(table: str) -> list[Setting]:
    """The keys of a table, in the model's order."""
    model = TABLES[table].model()
    if hasattr(model, "model_fields"):  # pydantic ([policy], [compression])
        return list(_pydantic_settings(table, model, ""))
    rows = [
        Setting(table, doc.key or item.name, item.name, doc, _default(item, doc))
        for item, doc in setting_fields(model)
    ]
    if table == "tiers":
        rows += [
            Setting(table, key, key, doc, False if doc.kind == "bool" else None)
            for key, doc in KEY_FILE_SETTINGS.items()
        ]
    return rows


def keys_of(table: str) -> list[str]:
    return [row.key for row in settings_of(table)]


def _default(item: dataclasses.Field[Any], doc: SettingDoc) -> Any:
    if item.default is not dataclasses.MISSING:
        return item.default
    if doc.default_text is not None:
        return None  # computed for the machine: the words say how
    factory = item.default_factory
    return None if factory is dataclasses.MISSING else factory()


def _pydantic_settings(table: str, model: Any, prefix: str) -> Iterator[Setting]:
    from pydantic import BaseModel  # here: building a command's flags must not import it

    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _pydantic_settings(table, annotation, f"{prefix}{name}.")
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, Mapping) else {}
        doc = extra.get(META_KEY) or SettingDoc(info.description or "", _kind(annotation))
        default = info.get_default(call_default_factory=True)
        yield Setting(table, prefix + name, name, doc, default)


def _kind(annotation: Any) -> str:
    text = str(annotation)
    for word, kind in (
        ("list", "list"),
        ("dict", "table"),
        ("bool", "bool"),
        ("int", "int"),
        ("float", "number"),
    ):
        if word in text:
            return kind
    return "string"


def toml_text(value: Any) -> str:
    """A value as it would be written in kvtier.toml (none: left out)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_text(v) for v in value) + "]"
    return json.dumps(str(value))


def size_text(nbytes: int) -> str:
    """A size as kvtier.toml may write it: "1GiB", "512MiB", else bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f'"{nbytes >> shift}{unit}"'
    return str(nbytes)
