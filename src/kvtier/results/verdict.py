"""The short verdict that ends `make demo`: per policy, what a returning user waited, what was
recomputed, what the tiers moved and what it cost, measured here and, beside it, the same
workload as the simulator projects it onto other hardware.

Both come from results files (`kvtier bench`'s and `kvtier simulate`'s have the same fields):
resumed-turn TTFT p50 / p99 from the summary, `tokens_recomputed`, bytes read plus written
over every tier, and from the run's bill (`config.runs[policy].bill`, `results/bill.py`) the
seconds spent recomputing and the dollars per 1M prompt tokens at `[policy.cost]`'s prices.

`closing` is the sentence under the table: which policy restored resumed turns fastest (lowest
p50 resumed-turn TTFT; `oracle`, which knows when each session returns, is a bound and never
the winner) and by how much against the next best and against `retain`. The run is too small
to call when any policy compared had fewer than `MIN_RESUMED` resumed turns, and too close to
call when the winner's p50 is not below `CLOSE` times the next best's (within 10%).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.results.report import Table
from kvtier.units import format_bytes

MIN_RESUMED = 10  # resumed turns per policy a call needs: a p50 of fewer moves with each turn
CLOSE = 0.9  # the winner's p50 must be under 0.9x the next best's: closer is within the noise
BOUND = "oracle"  # knows the future: a bound to compare with, not a policy to deploy

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


def closing(document: Mapping[str, Any], run: str = "this run") -> str:
    """One sentence about `run` (the document's): the winner on resumed-turn TTFT p50, by how
    much, and whether the run is large and clear enough to call."""
    p50, count = {}, {}
    for entry in document["runs"]:
        resumed = entry["summary"]["ttft_by_turn_kind"]["resumed"]
        count[entry["policy"]] = resumed.get("count", 0)
        if resumed.get("median_ms") is not None:
            p50[entry["policy"]] = resumed["median_ms"]
    ranked = sorted((p for p in p50 if p != BOUND), key=p50.__getitem__)
    if len(ranked) < 2:
        return (
            f"On {run}, fewer than two policies (oracle aside) had resumed turns: nothing to "
            "compare (run two or more policies on a workload whose sessions come back)."
        )
    best, second = ranked[0], ranked[1]
    ratio = p50[best] / p50[second] if p50[second] else 1.0
    against = [f"{ratio:.2f}x {second}'s {_ms(p50[second])} ms (the next best)"]
    if "retain" in p50 and "retain" not in (best, second):
        against.append(f"{p50[best] / p50['retain']:.2f}x retain's {_ms(p50['retain'])} ms")
    sentence = (
        f"On {run}, {best} restores resumed turns fastest: p50 resumed TTFT "
        f"{_ms(p50[best])} ms, {' and '.join(against)}"
    )
    if BOUND in p50:
        sentence += f"; {BOUND}, which knows when each session returns, {_ms(p50[BOUND])} ms"
    fewest = min(count[p] for p in ranked)
    if fewest < MIN_RESUMED:
        return (
            f"{sentence}. Too small to call: {fewest} resumed turns for a policy, and a call "
            f"needs {MIN_RESUMED} or more each (replay more sessions)."
        )
    if ratio >= CLOSE:
        return (
            f"{sentence}. Too close to call: {best} is within {1 - CLOSE:.0%} of {second}, "
            "inside a run's noise."
        )
    return f"{sentence}."


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
