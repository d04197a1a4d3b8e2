"""One argparse group per table, the same in every command that reads the table: a dedicated
flag for each key marked `flag` (named after the key: `host_bytes` is `--host-bytes`), and
`--<table>-set KEY=VALUE` for any key. Flags parse to None when not given, so the file's or
the environment's value (or the default) stands; `from_args` hands the given ones to
`load_settings`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.settings.catalog import Setting, settings_of
from kvtier.workload.flags import add_hidden_alias

if TYPE_CHECKING:
    from kvtier.settings.load import Settings

GROUP_TITLES = {
    "tiers": "KV tiers (the [tiers] table)",
    "scheduling": "scheduling (the [scheduling] table)",
    "policy": "retention policy (the [policy] table)",
    "server": "server (the [server] table)",
    "compression": "compression (the [compression] table)",
}
# [policy] keys with a flag of their own (the policy's name is --policy), spelled out here:
# the policy's model loads its numba kernels, which building a parser must not wait for
POLICY_FLAGS = {
    "max_accuracy_loss": (
        float,
        "POINTS",
        "let the cost policy store chunks on disk/remote as int8/int4 where their measured "
        "kvtier eval loss is at most this (default: 0.0)",
    ),
    "accuracy_file": (
        str,
        "PATH",
        "accuracy figures (kvtier eval --kv-forms ... writes DIR/forms.json); default: "
        "kvtier's bundled figures for the model, if any",
    ),
}


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="kvtier.toml (default: $KVTIER_CONFIG, else ./kvtier.toml when present)",
    )


def add_table_arguments(
    parser: argparse.ArgumentParser,
    table: str,
    *,
    skip: Sequence[str] = (),
    defaults: Mapping[str, str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """The table's group: its flagged keys (less `skip`) and --<table>-set. `defaults`: key ->
    the command's own default, in words, for the help (the command applies it); `aliases`:
    key -> a hidden older spelling of its flag, still accepted."""
    group = parser.add_argument_group(GROUP_TITLES[table])
    if table == "policy":
        if "name" not in skip:
            group.add_argument(
                "--policy",
                metavar="NAME",
                help="cost (default), retain, recompute, offload, ttl, a plugin or module:Class",
            )
        for key, (convert, metavar, help_text) in POLICY_FLAGS.items():
            if key not in skip:
                flag = "--" + key.replace("_", "-")
                group.add_argument(flag, dest=key, type=convert, metavar=metavar, help=help_text)
    elif table != "compression":  # a preset or a list of presses: --compression-set only
        for row in settings_of(table):
            if row.doc.flag and row.key not in skip:
                action = _add_flag(group, row, (defaults or {}).get(row.key))
                if row.key in (aliases or {}):
                    add_hidden_alias(group, action, (aliases or {})[row.key])
    group.add_argument(
        f"--{table}-set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help=f"set any [{table}] key, e.g. {_example(table)} (repeatable)",
    )


def add_key_flags(parser: argparse.ArgumentParser, table: str, keys: Sequence[str]) -> None:
    """Only `keys`' dedicated flags of the table (no --<table>-set): for a command that reads
    just those keys of the table, as `kvtier calibrate` reads the two that change a step's
    time."""
    group = parser.add_argument_group(GROUP_TITLES[table])
    rows = {row.key: row for row in settings_of(table)}
    for key in keys:
        _add_flag(group, rows[key], None)


def flag_values(args: argparse.Namespace, table: str) -> dict[str, Any]:
    """The table's dedicated flags as given (absent ones: None)."""
    if table == "policy":
        keys = list(POLICY_FLAGS)
    elif table == "compression":
        keys = []
    else:
        keys = [row.key for row in settings_of(table) if row.doc.flag]
    return {key: getattr(args, key, None) for key in keys}


def from_args(
    args: argparse.Namespace,
    tables: Sequence[str],
    *,
    policy_name: str | None = None,
    engine_tiers: bool = True,
) -> Settings:
    """The effective settings of a command whose parser has `tables`' groups (`policy_name`:
    the policy a run is for, over --policy; `engine_tiers`: see `load_settings`)."""
    # imported here: the loader validates [policy], whose model loads numba kernels
    from kvtier.settings.load import config_path, load_settings

    return load_settings(
        config_path(getattr(args, "config", None)),
        sets={table: getattr(args, f"{table}_set", None) or [] for table in tables},
        flags={table: flag_values(args, table) for table in tables},
        policy_name=policy_name or getattr(args, "policy", None),
        engine_tiers=engine_tiers,
    )


def _add_flag(group: Any, row: Setting, default_words: str | None) -> argparse.Action:
    help_text = _first_clause(row.doc.help) + f" (default: {default_words or row.default_words})"
    kind = row.doc.kind
    if kind.startswith("bool or"):  # write_through: true, false or one word
        word = row.doc.help.split("`")[1] if "`" in row.doc.help else "selective"
        action = group.add_argument(
            row.flag,
            dest=row.key,
            nargs="?",
            const=True,
            type=_one_word(word),
            metavar=word,
            help=help_text,
        )
        group.add_argument(
            row.flag.replace("--", "--no-", 1),
            dest=row.key,
            action="store_const",
            const=False,
            help=argparse.SUPPRESS,
        )
        return action
    if kind == "bool":
        return group.add_argument(
            row.flag, dest=row.key, action=argparse.BooleanOptionalAction, help=help_text
        )
    convert = {"int": int, "number": float}.get(kind, str)
    metavar = {"size": "SIZE", "path": "PATH", "int": "N", "number": "X"}.get(kind, "VALUE")
    return group.add_argument(
        row.flag,
        dest=row.key,
        type=convert,
        choices=row.doc.choices or None,
        metavar=metavar if not row.doc.choices else None,
        help=help_text,
    )


def _one_word(word: str) -> Any:
    def parse(text: str) -> str:
        if text != word:
            raise argparse.ArgumentTypeError(f"only {word!r} (or nothing), not {text!r}")
        return text

    return parse


def _first_clause(text: str) -> str:
    """A flag's help: the key's help without its links and code marks."""
    text = re.sub(r" ?\(\[[^]]*\]\([^)]*\)\)", "", text)  # " ([page](link))"
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", text)  # "[page](link)"
    return text.replace("`", "").replace("%", "%%")


def _example(table: str) -> str:
    return {
        "tiers": "chunk_tokens=64",
        "scheduling": "block_size=32",
        "policy": "cost.horizon_s=10",
        "server": "max_tokens_default=128",
        "compression": 'preset="edge_device"',
    }[table]
