"""Aggregate per-sample results into score per task x method x ratio; write JSON, a Markdown
table (also printed with rich) and a plot of average score against KV bytes held."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from statistics import fmean
from typing import Any

from kvtier.eval.runner import EvalRun, SampleResult

MIB = 1 << 20


def summarize(run: EvalRun) -> list[dict[str, Any]]:
    """One row per method run (spec): score per task, average, bytes held, speed."""
    by_spec: dict[str, list[SampleResult]] = defaultdict(list)
    for result in run.samples:
        by_spec[result.spec].append(result)
    timings = {t.spec: t for t in run.timings}
    rows = []
    for spec, results in by_spec.items():
        per_task: dict[str, list[float]] = defaultdict(list)
        for r in results:
            per_task[r.task].append(r.score)
        held = [r.kv_bytes_held for r in results if r.kv_bytes_held is not None]
        tokens_held = [r.kv_tokens_held for r in results if r.kv_tokens_held is not None]
        itl = [r.itl_s_mean for r in results if r.itl_s_mean is not None]
        timing = timings.get(spec)
        rows.append(
            {
                "spec": spec,
                "method": results[0].method,
                "ratio": results[0].ratio,
                "num_samples": len(results),
                "scores": {task: 100 * fmean(s) for task, s in per_task.items()},
                "average": 100 * fmean(fmean(s) for s in per_task.values()),
                "kv_bytes_held_mean": fmean(held) if held else None,
                "kv_tokens_held_mean": fmean(tokens_held) if tokens_held else None,
                "prompt_tokens_mean": fmean(r.num_prompt_tokens for r in results),
                # Per request; in a batch a decode step also carries other prompts' prefill
                # chunks, so this is the latency a request saw, not the decode speed alone.
                "itl_ms_mean": 1000 * fmean(itl) if itl else None,
                "wall_s": timing.wall_s if timing else None,
                # Prompt and generated tokens of the run over its wall time.
                "tokens_per_s": (timing.prompt_tokens + timing.output_tokens) / timing.wall_s
                if timing
                else None,
            }
        )
    full = next((r for r in rows if r["spec"] == "full"), None)
    for row in rows:
        base = full and full["kv_bytes_held_mean"]
        held = row["kv_bytes_held_mean"]
        row["kv_vs_full"] = held / base if base and held is not None else None
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    tasks = sorted({t for row in rows for t in row["scores"]})
    header = ["method", *tasks, "avg", "KV MiB held", "KV vs full", "n", "wall s", "tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["spec"]]
        cells += [_num(row["scores"].get(t)) for t in tasks]
        cells += [
            _num(row["average"]),
            _num(row["kv_bytes_held_mean"] / MIB if row["kv_bytes_held_mean"] else None, 2),
            _num(100 * row["kv_vs_full"] if row["kv_vs_full"] is not None else None, 0) + "%",
            str(row["num_samples"]),
            _num(row["wall_s"]),
            _num(row["tokens_per_s"], 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    tasks = sorted({t for row in rows for t in row["scores"]})
    table = Table(title="kvtier eval: score (RULER string match, 0-100) per task")
    for column in ["method", *tasks, "avg", "KV MiB", "KV/full", "wall s"]:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        held = row["kv_bytes_held_mean"]
        table.add_row(
            row["spec"],
            *[_num(row["scores"].get(t)) for t in tasks],
            _num(row["average"]),
            _num(held / MIB if held else None, 2),
            _num(100 * row["kv_vs_full"], 0) + "%" if row["kv_vs_full"] is not None else "-",
            _num(row["wall_s"]),
        )
    console = Console()
    if not console.is_terminal:  # piped to a log: do not squeeze the table into 80 columns
        console = Console(width=200)
    console.print(table)


def write_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    full = next((r for r in rows if r["spec"] == "full"), None)
    methods = dict.fromkeys(r["method"] for r in rows if r["spec"] != "full")
    for method in methods:
        points = [r for r in rows if r["method"] == method and r["kv_bytes_held_mean"]]
        if full and full["kv_bytes_held_mean"] and all(p["ratio"] is not None for p in points):
            points = [full, *points]  # ratio 0 of every eviction method is the full cache
        points.sort(key=lambda r: r["kv_bytes_held_mean"])
        xs = [p["kv_bytes_held_mean"] / MIB for p in points]
        ax.plot(xs, [p["average"] for p in points], marker="o", label=method)
    if full and full["kv_bytes_held_mean"]:
        ax.scatter([full["kv_bytes_held_mean"] / MIB], [full["average"]], c="k", zorder=3)
        ax.annotate("full", (full["kv_bytes_held_mean"] / MIB, full["average"]))
    ax.set_xlabel("KV held per request after compression (MiB, measured from the pool)")
    ax.set_ylabel("average score (0-100)")
    ax.set_title("Score vs KV bytes held")
    ax.grid(alpha=0.3)
    if methods:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(
    path: Path, settings: dict[str, Any], rows: list[dict[str, Any]], run: EvalRun
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"settings": settings, "summary": rows, **run.to_dict()}
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
