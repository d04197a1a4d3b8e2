"""The documentation stays documentation: true of the code, readable, no lab notebook.

- No page in docs/ or README.md names a path on one machine (`/work/...`, `/tmp/...`) or
  carries a work-log marker (a dated status line, a branch, a commit id, a numbered session,
  issue or round): how a figure was reached belongs in a dated record under
  benchmarks/records/, which the docs link to.
- No page is longer than MAX_LINES.
- Every relative link in docs/, README.md and the records points at a file that exists.
- Every record opens with its date, machine, command and verdict, and the index lists it.
- The CLI reference is the parsers' own (regenerate it with
  `.venv/bin/python tests/test_docs.py --write-cli`), the configuration reference's key
  tables are generated from the settings (`--write-config`), every `kvtier.toml` key the
  configuration reference names exists (`[policy]`, `[tiers]`, `[server]`), the `[tiers]` and
  `[server]` tables name every key the code accepts, and the metrics reference names exactly
  the metrics `kvtier serve` exports.

PAGES_PENDING_REWRITE are exempt from the first two checks until they are restructured.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RECORDS = REPO / "benchmarks" / "records"
CLI_REFERENCE = DOCS / "reference" / "cli.md"
CONFIG_REFERENCE = DOCS / "reference" / "config.md"
METRICS_REFERENCE = DOCS / "reference" / "metrics.md"
MAX_LINES = 500

# Pages still to be restructured (their dated records moved out, present tense): exempt from
# the path, marker and length checks until then. Empty this set as each page is rewritten.
PAGES_PENDING_REWRITE: set[str] = set()

MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|root|tmp|home|Users)/")
WORK_LOG = {
    "a dated status line": re.compile(r"\bstatus\b[^.\n]{0,20}\b20\d\d-\d\d-\d\d", re.I),
    "a branch name": re.compile(r"\bbranch(?:es)? `[^`]+`", re.I),
    "a commit id": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a numbered session": re.compile(r"\bsession \d+\b", re.I),
    "an issue number": re.compile(r"\bissue #?\d+", re.I),
    "a numbered round": re.compile(r"\bround \d+\b", re.I),
}


def doc_pages(*, checked: bool) -> list[Path]:
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    if checked:
        pages = [page for page in pages if page.name not in PAGES_PENDING_REWRITE]
    return pages


def _where(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_the_exempt_pages_exist() -> None:
    """A page in PAGES_PENDING_REWRITE that is renamed or gone is no longer pending."""
    assert all((DOCS / name).exists() for name in PAGES_PENDING_REWRITE)


@pytest.mark.parametrize("page", doc_pages(checked=True), ids=_where)
def test_no_machine_paths(page: Path) -> None:
    hits = [
        f"{_where(page)}:{number}: {line.strip()}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not hits, "absolute paths of one machine:\n" + "\n".join(hits)


@pytest.mark.parametrize("page", doc_pages(checked=True), ids=_where)
def test_no_work_log_markers(page: Path) -> None:
    hits = [
        f"{_where(page)}:{number}: {what}: {match.group(0)!r}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for what, pattern in WORK_LOG.items()
        if (match := pattern.search(line))
    ]
    assert not hits, "work-log markers (move them to a record):\n" + "\n".join(hits)


@pytest.mark.parametrize("page", doc_pages(checked=True), ids=_where)
def test_pages_stay_short(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_where(page)} has {lines} lines (at most {MAX_LINES})"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _linked_pages() -> list[Path]:
    return [*doc_pages(checked=False), *sorted(RECORDS.glob("*.md")), REPO / "benchmarks/README.md"]


@pytest.mark.parametrize("page", _linked_pages(), ids=_where)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_where(page)} links to missing files: {broken}"


def test_every_record_has_its_header_and_is_indexed() -> None:
    index = (RECORDS / "README.md").read_text()
    records = sorted(p for p in RECORDS.glob("*.md") if p.name != "README.md")
    assert records
    for record in records:
        assert re.match(r"20\d\d-\d\d-\d\d-[a-z0-9-]+\.md$", record.name), record.name
        head = record.read_text().split("\n\n", 2)[1]
        for field in ("Date", "Machine", "Command", "Verdict"):
            assert f"- **{field}:** " in head, f"{record.name}: no {field} line"
        assert f"({record.name})" in index, f"{record.name} is not in the records index"


def cli_reference() -> str:
    """The CLI reference, as the parsers define it."""
    sys.path.insert(0, str(REPO / "src"))
    from kvtier.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = [
        "# CLI reference",
        "",
        "Every `kvtier` command and flag, generated from the parsers themselves",
        "(`kvtier.cli.build_parser`; regenerate with `.venv/bin/python tests/test_docs.py",
        "--write-cli`). `kvtier COMMAND --help` prints the same. Bad input always gives one",
        "`kvtier: error: ...` line and exit code 2. Guides: [../README.md](../README.md).",
    ]
    for name, sub in commands.choices.items():
        formatter = sub._get_formatter()
        out += ["", f"## `kvtier {name}`", "", sub.description or "", ""]
        out += ["| argument | what |", "|---|---|"]
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or "-h" in action.option_strings:
                continue
            if action.option_strings:
                metavar = ""
                if action.nargs != 0:
                    metavar = " " + formatter._format_args(action, action.dest.upper())
                flag = ", ".join(action.option_strings) + metavar
            else:
                flag = formatter._format_args(action, action.dest)
            text = " ".join(formatter._expand_help(action).split()) if action.help else ""
            out.append(_table_row(flag, text))
    return "\n".join(out) + "\n"


def _table_row(flag: str, text: str) -> str:
    return "| `{}` | {} |".format(flag.replace("|", "\\|"), text.replace("|", "\\|"))


def test_the_cli_reference_is_the_parsers() -> None:
    assert CLI_REFERENCE.read_text() == cli_reference(), (
        "docs/reference/cli.md is out of date: run .venv/bin/python tests/test_docs.py --write-cli"
    )


def test_every_policy_key_the_configuration_reference_names_exists() -> None:
    from kvtier.policy.config import PolicyConfig

    section = CONFIG_REFERENCE.read_text().split("## `[policy]`", 1)[1].split("\n## ", 1)[0]
    keys = re.findall(r"^\| `([a-z_.<>,{}]+)`", section, re.M)
    assert keys
    names = []
    for key in keys:  # `profile.prefill_{fixed,token,pair}_s` names three keys
        if m := re.search(r"\{([a-z_,]+)\}", key):
            names += [key.replace(m.group(0), alt) for alt in m.group(1).split(",")]
        else:
            names.append(key)
    for name in names:
        model = PolicyConfig
        for part in name.split("."):
            if part.startswith("<"):
                break  # a tier or form name: the level above exists
            field = model.model_fields.get(part)
            assert field is not None, f"[policy] {name}: no field {part!r}"
            annotation = field.annotation
            model = annotation if isinstance(annotation, type) else model


def _reference_keys(table: str) -> list[str]:
    """The keys the configuration reference's `[table]` section lists in its key column."""
    section = CONFIG_REFERENCE.read_text().split(f"## `[{table}]`", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_.<>]+)`", section, re.M)


def test_the_tiers_keys_of_the_configuration_reference_are_the_tables():
    from kvtier.cache.tiers_file import table_keys

    keys = _reference_keys("tiers")
    assert keys
    unknown = sorted(set(keys) - set(table_keys()))
    assert not unknown, f"[tiers] keys the reference names that the table does not take: {unknown}"
    missing = sorted(set(table_keys()) - set(keys))
    assert not missing, f"[tiers] keys missing from docs/reference/config.md: {missing}"


def test_the_server_keys_of_the_configuration_reference_are_the_tables():
    from kvtier.errors import KvtierError
    from kvtier.settings.server import ServerConfig, tenant_from_mapping

    keys = _reference_keys("server")
    assert keys
    own = [key for key in keys if not key.startswith("tenants.")]
    tenant = [key.split(".", 2)[2] for key in keys if key.startswith("tenants.")]
    known = set(ServerConfig.__dataclass_fields__) - {"tenants"}
    assert not sorted(set(own) - known), f"[server] keys not in ServerConfig: {set(own) - known}"
    assert not sorted(known - set(own)), (
        f"[server] keys missing from the reference: {known - set(own)}"
    )
    with pytest.raises(KvtierError, match="unknown server setting"):
        ServerConfig.from_mapping({"no_such_key": 1})  # the table takes what the fields are
    assert set(tenant) == {"api_key", "device_quota_bytes"}
    tenant_from_mapping("t", {"api_key": "k", "device_quota_bytes": 1})


def _exported_metrics() -> set[str]:
    """Every sample name `kvtier serve`'s /metrics has, with tiers and sessions reported."""
    from types import SimpleNamespace

    from kvtier.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.tier_collector.tiers = {
        "policy": "cost",
        "tiers": {"host": {}},
        "decisions": {"keep": 1},
    }
    metrics.session_collector.stats = SimpleNamespace(num_sessions=0, num_sessions_evicted=0)
    names = set()
    for family in metrics.registry.collect():
        if family.type == "histogram":
            names.add(family.name)  # documented by its base name
        elif family.type == "counter":
            names.add(family.name + "_total")
        else:
            names.add(family.name)
    return names


def test_the_metrics_reference_names_exactly_the_exported_metrics():
    documented = set(re.findall(r"^\| `(kvtier:[a-z0-9_]+)`", METRICS_REFERENCE.read_text(), re.M))
    exported = _exported_metrics()
    assert documented
    assert not sorted(documented - exported), f"not exported: {sorted(documented - exported)}"
    assert not sorted(exported - documented), f"not documented: {sorted(exported - documented)}"


def test_the_configuration_reference_is_generated_from_the_settings():
    """The key tables of docs/reference/config.md are the settings' own words and defaults."""
    from kvtier.settings.reference import rewrite

    page = CONFIG_REFERENCE.read_text()
    assert page.count("<!-- generated: ") >= 3  # tiers, scheduling, server
    assert rewrite(page) == page, (
        "docs/reference/config.md is out of date: run "
        ".venv/bin/python tests/test_docs.py --write-config"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-cli"]:
        CLI_REFERENCE.parent.mkdir(exist_ok=True)
        CLI_REFERENCE.write_text(cli_reference())
        print(f"wrote {CLI_REFERENCE.relative_to(REPO)}")
    elif sys.argv[1:] == ["--write-config"]:
        from kvtier.settings.reference import rewrite

        CONFIG_REFERENCE.write_text(rewrite(CONFIG_REFERENCE.read_text()))
        print(f"wrote {CONFIG_REFERENCE.relative_to(REPO)}")
    else:
        sys.exit("usage: python tests/test_docs.py --write-cli | --write-config")
