"""The key tables of docs/reference/config.md, generated from the settings: a block between
`<!-- generated: TABLE -->` and `<!-- end generated -->` is rewritten from the table's keys
(tests/test_docs.py fails when the page and the code drift; `--write-config` rewrites it)."""

from __future__ import annotations

import re

from kvtier.settings.catalog import settings_of

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


def rewrite(page: str) -> str:
    """The page with every generated block regenerated."""
    return _BLOCK.sub(lambda m: m.group(1) + key_table(m.group(2)) + m.group(3), page)
