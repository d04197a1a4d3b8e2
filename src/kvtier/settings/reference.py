"""The key tables of docs/reference/config.md, generated from the settings: a block between
`<!-- generated: TABLE -->` and `<!-- end generated -->` is rewritten from the table's keys
(tests/test_docs.py fails when the page and the code drift; `--write-config` rewrites it)."""

from __future__ import annotations

import re

from kvtier.settings.catalog import TABLES, settings_of

_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n).*?(<!-- end generated -->)", re.S)


def key_table(table: str) -> str:
    """The markdown table of one table's keys: key, type, default, what; and its flag and
    environment variable where it has them."""
    lines = ["| key | type | default | what |", "|---|---|---|---|"]
    for row in settings_of(table):
        kind = row.doc.kind
        if row.doc.choices:
            kind = " \\| ".join(f"`{choice}`" for choice in row.doc.choices)
        default = row.default_words
        if row.doc.default_text is None:
            default = f"`{default}`"
        flag = f" `{row.flag}`" if row.doc.flag else ""
        text = row.doc.help.replace("|", "\\|")
        lines.append(f"| `{row.key}` | {kind} | {default} | {text}{';' if flag else ''}{flag} |")
    return "\n".join(lines) + "\n"


def table_list() -> str:
    """The markdown table of the tables: what each holds and which commands read it."""
    lines = ["| table | what | read by |", "|---|---|---|"]
    for table in TABLES.values():
        lines.append(f"| [`[{table.name}]`](#{table.name}) | {table.what} | {table.read_by} |")
    return "\n".join(lines) + "\n"


def rewrite(page: str) -> str:
    """The page with every generated block regenerated (`tables`: the list of tables)."""

    def block(match: re.Match[str]) -> str:
        name = match.group(2)
        body = table_list() if name == "tables" else key_table(name)
        return match.group(1) + body + match.group(3)

    return _BLOCK.sub(block, page)
