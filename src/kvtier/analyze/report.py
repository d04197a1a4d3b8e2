"""Present an Analysis: rich tables for people, a JSON dict for programs.

JSON schema `kvtier.analyze/1` (times in seconds, lengths in tokens, sizes in bytes, shares in
0..1; `decode_tok_s` is null when gaps run arrival to arrival):

    schema, source, notes, errors (first 50), error_count, length_scale, resume_after_s,
    decode_tok_s, requests, sessions, duration_s,
    turn_kinds {new, continuing, resumed: {count, share}},
    gaps_s {count, mean, p10, p25, p50, p75, p90, p99, max, at_zero,
      returned_within {"10", "30", ...: share}},
    turns_per_session {mean, p50, p90, max, histogram {"1": sessions, ...}},
    prompt_tokens, output_tokens {count, mean, p50, p90, p99, max},
    history_growth [{turn, requests, mean_prompt_tokens, mean_added_tokens}],
    prefix_sharing {prompt_tokens, reused_tokens, reused_share, reused_within_session_tokens,
      reused_cross_session_tokens, cross_session_share, shared_prefix_tokens,
      shared_prefix_share, distinct_shared_prefixes, top_shared_prefixes [{tokens, sessions}],
      reused_block_tokens, shared_block_tokens},
    kv {model, kv_dtype, bytes_per_token, longest_context_tokens, longest_context_bytes,
      idle_peak_bytes, idle_mean_bytes, idle_peak_sessions, active_peak_bytes, keep_all_bytes,
      reused_prefix_bytes, shared_prefix_bytes}
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.analyze.metrics import RETURN_WITHIN_S, Analysis, Summary
from kvtier.units import format_bytes, format_seconds

SCHEMA = "kvtier.analyze/1"
_MAX_JSON_ERRORS = 50
_GROWTH_ROWS = 10


def to_json(a: Analysis) -> dict[str, Any]:
    kinds = {
        name: {"count": count, "share": a.kinds.share(count)}
        for name, count in (
            ("new", a.kinds.new),
            ("continuing", a.kinds.continuing),
            ("resumed", a.kinds.resumed),
        )
    }
    gaps: dict[str, Any] = {"count": len(a.gaps_s)}
    if len(a.gaps_s):
        points = np.percentile(a.gaps_s, [10, 25, 50, 75, 90, 99])
        gaps |= {"mean": float(a.gaps_s.mean()), "max": float(a.gaps_s.max())}
        gaps |= {f"p{p}": float(v) for p, v in zip((10, 25, 50, 75, 90, 99), points, strict=True)}
    gaps["at_zero"] = a.at_zero_gaps
    gaps["returned_within"] = {f"{t:g}": a.returned_within(t) for t in RETURN_WITHIN_S}
    tps = a.turns_per_session
    p = a.prefix
    return {
        "schema": SCHEMA,
        "source": a.source,
        "notes": a.notes,
        "errors": a.errors[:_MAX_JSON_ERRORS],
        "error_count": len(a.errors),
        "length_scale": a.length_scale,
        "resume_after_s": a.resume_after_s,
        "decode_tok_s": a.decode_tok_s if math.isfinite(a.decode_tok_s) else None,
        "requests": a.requests,
        "sessions": a.sessions,
        "duration_s": a.duration_s,
        "turn_kinds": kinds,
        "gaps_s": gaps,
        "turns_per_session": {
            "mean": float(tps.mean()),
            "p50": float(np.percentile(tps, 50)),
            "p90": float(np.percentile(tps, 90)),
            "max": int(tps.max()),
            "histogram": {str(n): count for n, count in sorted(Counter(tps.tolist()).items())},
        },
        "prompt_tokens": asdict(a.prompt_tokens),
        "output_tokens": asdict(a.output_tokens),
        "history_growth": [asdict(row) for row in a.growth],
        "prefix_sharing": asdict(p)
        | {
            "reused_share": _share(p.reused_tokens, p.prompt_tokens),
            "cross_session_share": _share(p.reused_cross_session_tokens, p.prompt_tokens),
            "shared_prefix_share": _share(p.shared_prefix_tokens, p.prompt_tokens),
            "top_shared_prefixes": [
                {"tokens": tokens, "sessions": sessions}
                for tokens, sessions in p.top_shared_prefixes
            ],
        },
        "kv": asdict(a.kv),
    }


def print_report(a: Analysis, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"[bold]{a.source}[/bold]")
    for note in a.notes:
        console.print(f"  {note}")
    if a.errors:
        console.print(f"  [yellow]{len(a.errors):,} bad record(s) skipped; first: {a.errors[0]}")
    console.print(_overview(a))
    console.print(_kinds_and_gaps(a))
    console.print(_growth(a))
    console.print(_prefix(a))
    console.print(_kv(a))


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _pairs(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def _tokens(summary: Summary) -> str:
    return (
        f"mean {summary.mean:,.0f}  p50 {summary.p50:,.0f}  p99 {summary.p99:,.0f}  "
        f"max {summary.max:,.0f}"
    )


def _overview(a: Analysis) -> Table:
    tps = a.turns_per_session
    rows = [
        ("requests / sessions", f"{a.requests:,} / {a.sessions:,}"),
        ("duration", format_seconds(a.duration_s)),
        (
            "turns per session",
            f"mean {tps.mean():.2f}  p90 {np.percentile(tps, 90):.0f}  max {tps.max()}",
        ),
        ("prompt tokens", _tokens(a.prompt_tokens)),
        ("output tokens", _tokens(a.output_tokens)),
    ]
    if a.length_scale != 1.0:
        rows.append(("length scale", f"{a.length_scale:.4g}"))
    return _pairs("Workload", rows)


def _kinds_and_gaps(a: Analysis) -> Table:
    rate = f"from estimated end at {a.decode_tok_s:g} tok/s"
    if not math.isfinite(a.decode_tok_s):
        rate = "arrival to arrival"
    table = Table(
        title=f"Turn kinds (resumed: gap > {a.resume_after_s:g} s; gaps {rate})",
        title_justify="left",
    )
    for column in ("new", "continuing", "resumed", "gap p10", "p50", "p90", "p99"):
        table.add_column(column, justify="right")
    k = a.kinds
    cells = [f"{n:,} ({k.share(n):.1%})" for n in (k.new, k.continuing, k.resumed)]
    if len(a.gaps_s):
        cells += [format_seconds(v) for v in np.percentile(a.gaps_s, [10, 50, 90, 99])]
    else:
        cells += ["-"] * 4
    table.add_row(*cells)
    if a.at_zero_gaps:
        table.caption = (
            f"{a.at_zero_gaps:,} returning turns arrived before the previous answer's "
            "estimated end (gap 0)"
        )
    within = Table(title="Returning turns back within", title_justify="left")
    for t in RETURN_WITHIN_S:
        within.add_column(format_seconds(t), justify="right")
    within.add_row(*(f"{a.returned_within(t):.1%}" for t in RETURN_WITHIN_S))
    grid = Table.grid(padding=(0, 4))
    grid.add_row(table)
    grid.add_row(within)
    return grid


def _growth(a: Analysis) -> Table:
    table = Table(title="History growth (prompt tokens by turn)", title_justify="left")
    for column in ("turn", "requests", "mean prompt tokens", "mean added since last turn"):
        table.add_column(column, justify="right")
    for row in a.growth[:_GROWTH_ROWS]:
        table.add_row(
            str(row.turn),
            f"{row.requests:,}",
            f"{row.mean_prompt_tokens:,.0f}",
            f"{row.mean_added_tokens:,.0f}" if row.turn > 1 else "-",
        )
    rest = a.growth[_GROWTH_ROWS:]
    if rest:
        count = sum(row.requests for row in rest)
        prompt = sum(row.requests * row.mean_prompt_tokens for row in rest) / count
        added = sum(row.requests * row.mean_added_tokens for row in rest) / count
        table.add_row(
            f"{rest[0].turn}-{rest[-1].turn}", f"{count:,}", f"{prompt:,.0f}", f"{added:,.0f}"
        )
    return table


def _prefix(a: Analysis) -> Table:
    p = a.prefix
    top = ", ".join(f"{tokens:,} tok x {sessions:,}" for tokens, sessions in p.top_shared_prefixes)
    return _pairs(
        "Prefix sharing (unbounded cache, arrival order)",
        [
            ("prompt tokens", f"{p.prompt_tokens:,}"),
            ("reused from earlier requests", f"{_share(p.reused_tokens, p.prompt_tokens):.1%}"),
            ("  same session", f"{_share(p.reused_within_session_tokens, p.prompt_tokens):.1%}"),
            ("  other sessions", f"{_share(p.reused_cross_session_tokens, p.prompt_tokens):.1%}"),
            (
                "in prefixes shared across sessions",
                f"{_share(p.shared_prefix_tokens, p.prompt_tokens):.1%}",
            ),
            ("distinct shared prefixes (first turns)", f"{p.distinct_shared_prefixes:,}"),
            ("most shared (tokens x sessions)", top or "-"),
        ],
    )


def _kv(a: Analysis) -> Table:
    kv = a.kv
    return _pairs(
        f"KV footprint: {kv.model}, {kv.kv_dtype}, {kv.bytes_per_token:,.0f} B/token",
        [
            (
                "longest context",
                f"{kv.longest_context_tokens:,} tok = {format_bytes(kv.longest_context_bytes)}",
            ),
            (
                "idle sessions kept until they return: peak",
                f"{format_bytes(kv.idle_peak_bytes)} ({kv.idle_peak_sessions:,} sessions)",
            ),
            ("  mean over the trace", format_bytes(kv.idle_mean_bytes)),
            ("running turns: peak", format_bytes(kv.active_peak_bytes)),
            ("every session kept to the end", format_bytes(kv.keep_all_bytes)),
            ("distinct reused prefix blocks", format_bytes(kv.reused_prefix_bytes)),
            ("distinct cross-session prefix blocks", format_bytes(kv.shared_prefix_bytes)),
        ],
    )
