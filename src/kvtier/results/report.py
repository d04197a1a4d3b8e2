"""Present runs: Markdown tables for the terminal, the JSON result files, an HTML report.

Files a run writes into its output folder:

- `results.json` (schema `kvtier.results/1`): `{schema, source, config, runs: [{policy,
  summary, occupancy: [[t_s, {tier: bytes}], ...], itl_pooled: [[gap_s, count], ...] | null,
  requests_file}]}`; `summary` is `summary.summarize`'s dict (its docstring defines each field);
- `requests-<policy>.jsonl`: one `RequestRecord` per line, in arrival order;
- `report.md`, and with plots `report.html` + the PNGs of `plots.py`.

`kvtier simulate` and `kvtier bench` write the same files, so one reads and diffs the other's.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.results.records import (
    RESTORE_SOURCES,
    SCHEMA,
    STORE_TIERS,
    TURN_KINDS,
    RunRecords,
)
from kvtier.results.summary import summarize
from kvtier.units import format_bytes

Table = tuple[str, list[str], list[list[str]]]  # title, header, rows


def to_document(
    source: str, config: Mapping[str, Any], runs: Sequence[RunRecords]
) -> dict[str, Any]:
    """The results.json contents for these runs (summaries computed here)."""
    return {
        "schema": SCHEMA,
        "source": source,
        "config": dict(config),
        "runs": [
            {
                "policy": run.policy,
                "summary": summarize(run),
                "occupancy": [[s.t_s, s.used_bytes] for s in run.occupancy],
                "itl_pooled": None if run.itl_pooled is None else [list(p) for p in run.itl_pooled],
                "requests_file": _requests_file(run.policy),
            }
            for run in runs
        ],
    }


def write_results(
    out_dir: str | Path, document: Mapping[str, Any], runs: Sequence[RunRecords]
) -> list[Path]:
    """Write results.json, one requests-<policy>.jsonl per run and report.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(document), encoding="utf-8")
    for run in runs:
        path = out / _requests_file(run.policy)
        with path.open("w", encoding="utf-8") as handle:
            for record in run.requests:
                handle.write(json.dumps(record.to_dict()) + "\n")
        paths.append(path)
    return paths


def read_results(path: str | Path) -> dict[str, Any]:
    """A results.json (from `simulate` or `bench`), checked enough to compare it."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KvtierError(f"results file {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise KvtierError(f"cannot read results file {path}: {exc}") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        found = document.get("schema") if isinstance(document, dict) else type(document).__name__
        raise KvtierError(f"{path} is not a kvtier results file (schema {found!r}, not {SCHEMA!r})")
    runs = document.get("runs")
    if not isinstance(runs, list) or not all(
        isinstance(r, dict) and "policy" in r and isinstance(r.get("summary"), dict) for r in runs
    ):
        raise KvtierError(f"{path}: 'runs' must be a list of {{policy, summary, ...}} entries")
    return document


def tables(document: Mapping[str, Any]) -> list[Table]:
    """The comparison of all policies, then one breakdown per policy."""
    runs = document["runs"]
    # tiers no run had (not configured) would be columns of "-"
    tiers = [t for t in STORE_TIERS if any(t in run["summary"]["tier_bytes"] for run in runs)]
    header = [
        "policy",
        "done/failed",
        "req/s",
        "out tok/s",
        "TTFT mean/p50/p99 ms",
        "TPOT p50 ms",
        "ITL p99 ms",
        "stall p99 ms",
        "resumed TTFT p50/p99 ms",
        "recomputed tok",
        *(f"{tier} read/written" for tier in tiers),
    ]
    rows = []
    for run in runs:
        s = run["summary"]
        resumed = s["ttft_by_turn_kind"]["resumed"]
        rows.append(
            [
                run["policy"],
                f"{s['completed']:,}/{s['failed']:,}",
                f"{s['request_throughput']:.3g}",
                f"{s['output_throughput']:,.3g}",
                f"{_ms(s['mean_ttft_ms'])} / {_ms(s['median_ttft_ms'])} / {_ms(s['p99_ttft_ms'])}",
                _ms(s["median_tpot_ms"]),
                _ms(s["p99_itl_ms"]),
                _ms(s["p99_stall_ms"]),
                f"{_ms(resumed.get('median_ms'))} / {_ms(resumed.get('p99_ms'))}",
                f"{s['tokens_recomputed']:,}",
                *(_traffic(s["tier_bytes"].get(tier)) for tier in tiers),
            ]
        )
    out: list[Table] = [("Policies", header, rows)]
    failures = _failures(runs)
    if failures is not None:
        out.append(failures)
    for run in runs:
        out.append(_breakdown(run["policy"], run["summary"]))
    return out


def _failures(runs: Sequence[Mapping[str, Any]]) -> Table | None:
    """Why requests failed, per policy (None: none failed). A failed count alone ("19/10")
    does not say whether the policy or the set-up is to blame."""
    rows = [
        [run["policy"], f"{group['count']:,}", " ".join(group["example"].split())]
        for run in runs
        for group in run["summary"].get("failed_by_reason", {}).values()
    ]
    if not rows:
        return None
    return (
        "Failed requests by reason",
        ["policy", "failed", "error (the first of its kind)"],
        rows,
    )


def markdown(document: Mapping[str, Any]) -> str:
    return "\n\n".join(markdown_table(table) for table in tables(document)) + "\n"


def markdown_table(table: Table) -> str:
    """One table as Markdown, under its title."""
    title, header, rows = table
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_html(
    out_dir: str | Path, document: Mapping[str, Any], runs: Sequence[RunRecords]
) -> list[Path]:
    """report.html with the tables and the plots of `plots.py` (PNGs beside it)."""
    from kvtier.results.plots import write_plots  # matplotlib only when plots are wanted

    out = Path(out_dir)
    pngs = write_plots(runs, document, out)
    body = [f"<h1>kvtier {html.escape(document['source'])} results</h1>"]
    body.append(f"<pre>{html.escape(json.dumps(document['config'], indent=1))}</pre>")
    for title, header, rows in tables(document):
        body.append(f"<h2>{html.escape(title)}</h2><table>")
        body.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        for row in rows:
            body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        body.append("</table>")
    body += [
        f'<h2>{p.stem.replace("_", " ")}</h2><img src="{p.name}" alt="{p.stem}">' for p in pngs
    ]
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:auto}"
        "table{border-collapse:collapse;margin-bottom:1em}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvtier results</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return [*pngs, path]


def _breakdown(policy: str, s: Mapping[str, Any]) -> Table:
    header = ["group", "requests", "TTFT mean ms", "p50 ms", "p90 ms", "p99 ms"]
    rows = []
    for kind in TURN_KINDS:
        rows.append(_group_row(f"{kind} turns", s["ttft_by_turn_kind"][kind]))
    for source in RESTORE_SOURCES:
        group = s["ttft_resumed_by_source"][source]
        if group["count"]:
            rows.append(_group_row(f"resumed from {source}", group))
    for row in s["resume_latency_by_context"]:
        label = f"resumed, {row['min_tokens']:,}-{row['max_tokens']:,} tok"
        rows.append(_group_row(label, row))
    hits = ", ".join(f"{k} {v:.0%}" for k, v in s["hit_rate"].items() if v)
    return (
        f"{policy}: TTFT by turn kind and history source (history: {hits or 'none'})",
        header,
        rows,
    )


def _group_row(label: str, group: Mapping[str, Any]) -> list[str]:
    return [
        label,
        f"{group['count']:,}",
        *(_ms(group.get(key)) for key in ("mean_ms", "median_ms", "p90_ms", "p99_ms")),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _traffic(tier: Mapping[str, int] | None) -> str:
    if tier is None:
        return "-"
    return f"{format_bytes(tier['bytes_read'])} / {format_bytes(tier['bytes_written'])}"


def _requests_file(policy: str) -> str:
    return f"requests-{policy.replace(':', '_').replace('/', '_')}.jsonl"
