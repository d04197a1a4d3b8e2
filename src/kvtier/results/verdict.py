"""The short verdict that ends `make demo`: per policy, what a returning user waited, what was
recomputed, what the tiers moved and what it cost, measured here and, beside it, the same
workload as the simulator projects it onto other hardware.

Both come from results files (`kvtier bench`'s and `kvtier simulate`'s have the same fields):
resumed-turn TTFT p50 / p99 from the summary, `tokens_recomputed`, bytes read plus written
over every tier, and from the run's bill (`config.runs[policy].bill`, `results/bill.py`) the
seconds spent recomputing and the dollars per 1M prompt tokens at `[policy.cost]`'s prices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.plan.units import format_bytes
from kvtier.results.report import Table

HEADER = ["resumed TTFT p50 / p99 ms", "recomputed tok", "moved", "recompute s", "$ / 1M prompt"]


def verdict(document: Mapping[str, Any], title: str) -> Table:
    """One row per policy of a results document."""
    cells = _cells(document)
    return title, ["policy", *HEADER], [[policy, *row] for policy, row in cells.items()]


def side_by_side(
    measured: Mapping[str, Any], projected: Mapping[str, Any], labels: tuple[str, str]
) -> Table:
    """The policies both documents ran, two rows each: measured, then projected."""
    left, right = _cells(measured), _cells(projected)
    rows = []
    for policy in [p for p in left if p in right]:
        rows += [[policy, labels[0], *left[policy]], ["", labels[1], *right[policy]]]
    return f"Verdict: {labels[0]}, and {labels[1]}", ["policy", "run", *HEADER], rows


def render(table: Table) -> str:
    from kvtier.results.report import markdown_table

    return markdown_table(table)


def _cells(document: Mapping[str, Any]) -> dict[str, list[str]]:
    notes = document.get("config", {}).get("runs", {})
    out = {}
    for run in document["runs"]:
        s = run["summary"]
        resumed = s["ttft_by_turn_kind"]["resumed"]
        moved = sum(t["bytes_read"] + t["bytes_written"] for t in s["tier_bytes"].values())
        bill = notes.get(run["policy"], {}).get("bill")
        out[run["policy"]] = [
            f"{_ms(resumed.get('median_ms'))} / {_ms(resumed.get('p99_ms'))}",
            f"{s['tokens_recomputed']:,}",
            format_bytes(moved),
            "-" if bill is None else f"{bill['recompute_gpu_s']:,.1f}",
            "-" if bill is None else f"${bill['per_million_prompt_tokens']:,.3f}",
        ]
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
