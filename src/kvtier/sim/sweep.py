"""Where each retention policy wins: simulate a grid of resume share x context length x hardware
x policy and tabulate the winner of every cell on TTFT p50 and p99, output throughput and bytes
moved, with its margin over the runner-up.

A cell's workload is the generator's `default` preset with every session opening on a document
of exactly `context` tokens (so the history a resumed turn needs is about that long), and
`resume_share` of the returns being pauses of minutes (resumed turns) rather than quick
follow-ups (continuing turns). The table reports the resumed share of all turns it produced.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.policy.config import PolicyConfig
from kvtier.results.records import RunRecords
from kvtier.results.summary import summarize
from kvtier.sim.deployment import Deployment
from kvtier.sim.simulator import simulate
from kvtier.workload.generator import generate
from kvtier.workload.model import Request, flatten
from kvtier.workload.presets import preset_config

SCHEMA = "kvtier.sweep/1"
FIXED_POLICIES = ("retain", "offload", "ttl", "continuum", "close-lru")  # what `cost` must beat
RESUMED_FIELDS = ("resumed_mean_ms", "resumed_p50_ms", "resumed_p99_ms")
CELL = ("hardware", "resume_share", "context")  # what tells a sweep's cells apart
# (summary field, label, True when higher is better)
METRICS = (
    ("median_ttft_ms", "TTFT p50", False),
    ("p99_ttft_ms", "TTFT p99", False),
    ("resumed_mean_ms", "resumed TTFT mean", False),
    ("resumed_p50_ms", "resumed TTFT p50", False),
    ("resumed_p99_ms", "resumed TTFT p99", False),
    ("output_throughput", "output tok/s", True),
    ("bytes_moved", "bytes read+written", False),
)


@dataclass(frozen=True)
class SweepGrid:
    resume_shares: Sequence[float]
    contexts: Sequence[int]
    hardware: Sequence[str]
    policies: Sequence[str]
    sessions: int = 60
    seed: int = 0


def sweep_workload(resume_share: float, context: int, sessions: int, seed: int) -> list[Request]:
    config = preset_config(
        "default",
        sessions=sessions,
        followup_share=1.0 - resume_share,
        document_share=1.0,
        document_tokens={"mean": context, "cv": 0.0, "min_tokens": context, "max_tokens": context},
        max_history_tokens=max(32_768, 2 * context),
    )
    return flatten(generate(config, seed=seed))


def run_sweep(
    grid: SweepGrid,
    deployment: Callable[[str], Deployment],
    policy: Callable[[str], PolicyConfig],
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Simulate every cell; `deployment(hardware)` and `policy(name)` build the pieces."""
    rows = []
    for resume_share in grid.resume_shares:
        for context in grid.contexts:
            requests = sweep_workload(resume_share, context, grid.sessions, grid.seed)
            for hardware in grid.hardware:
                target = deployment(hardware)
                for name in grid.policies:
                    result = simulate(requests, target, policy(name))
                    row = _row(hardware, resume_share, context, name, result.run)
                    if result.calibration is not None:
                        row["brier"] = result.calibration.brier()
                    rows.append(row)
                    progress(
                        f"{hardware} resume {resume_share:g} context {context:,} {name}: "
                        f"{result.events:,} events in {result.wall_s:.1f} s"
                    )
    return {
        "schema": SCHEMA,
        "grid": {
            "resume_shares": list(grid.resume_shares),
            "contexts": list(grid.contexts),
            "hardware": list(grid.hardware),
            "policies": list(grid.policies),
            "sessions": grid.sessions,
            "seed": grid.seed,
        },
        "rows": rows,
        "winners": winners(rows),
        "versus": versus(rows),
    }


def _row(
    hardware: str, resume_share: float, context: int, policy: str, run: RunRecords
) -> dict[str, Any]:
    cell = {"hardware": hardware, "resume_share": resume_share, "context": context}
    return {**cell, **metrics_row(policy, run)}


def metrics_row(policy: str, run: RunRecords) -> dict[str, Any]:
    """One run's figures that the tables compare: latencies, resumed turns, bytes moved."""
    s = summarize(run)
    kinds = s["ttft_by_turn_kind"]
    turns = sum(kinds[k]["count"] for k in kinds)
    resumed = kinds["resumed"]["count"]
    traffic = s["tier_bytes"].values()
    return {
        "policy": policy,
        "resumed_share": resumed / turns if turns else 0.0,
        # what a retention policy decides: how many resumed turns found (most of) their history
        # still on the device; the rest loaded it from a tier or recomputed it
        "resumed_on_device": (
            s["ttft_resumed_by_source"]["device"]["count"] / resumed if resumed else 0.0
        ),
        "completed": s["completed"],
        "failed": s["failed"],
        "median_ttft_ms": s["median_ttft_ms"],
        "p99_ttft_ms": s["p99_ttft_ms"],
        # 0 when a cell has no resumed turn (then every policy ties on them)
        "resumed_mean_ms": kinds["resumed"].get("mean_ms", 0.0),
        "resumed_p50_ms": kinds["resumed"].get("median_ms", 0.0),
        "resumed_p99_ms": kinds["resumed"].get("p99_ms", 0.0),
        "output_throughput": s["output_throughput"],
        # per job (session): first request to last answer, and the part spent on the server
        "jct_mean_s": s["job_completion"]["completion"].get("mean_ms", 0.0) / 1000,
        "job_server_mean_s": s["job_completion"]["on_server"].get("mean_ms", 0.0) / 1000,
        "bytes_read": sum(t["bytes_read"] for t in traffic),
        "bytes_written": sum(t["bytes_written"] for t in traffic),
        "bytes_moved": sum(t["bytes_read"] + t["bytes_written"] for t in traffic),
    }


def winners(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per cell and metric: the best policy (several joined by "=" when within half a percent
    of each other), and its margin over the best of the rest as a share of that one's value
    (0.25 = 25% lower latency / bytes, or 25% more throughput). Fewer failed requests rank
    first: latencies leave failed requests out."""
    cells: dict[tuple[str, float, int], list[Mapping[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["hardware"], row["resume_share"], row["context"]), []).append(row)
    out = []
    for (hardware, resume_share, context), group in cells.items():
        entry: dict[str, Any] = {
            "hardware": hardware,
            "resume_share": resume_share,
            "context": context,
            "resumed_share": group[0]["resumed_share"],
        }
        for field, _, higher in METRICS:
            # a run that failed requests loses to one that did not: its latencies leave them out
            ranked = sorted(
                group,
                key=lambda r: (r["failed"], -r[field] if higher else r[field], r["policy"]),
            )
            best = ranked[0]
            tied = [
                r for r in ranked if r["failed"] == best["failed"] and same(r[field], best[field])
            ]
            rest = [r for r in ranked if r not in tied]
            margin = None
            if rest and rest[0][field]:
                margin = abs(rest[0][field] - best[field]) / abs(rest[0][field])
            entry[field] = {
                "policy": "=".join(sorted(r["policy"] for r in tied)),
                "value": best[field],
                "margin": margin,
            }
        out.append(entry)
    return out


def versus(
    rows: Sequence[Mapping[str, Any]],
    challenger: str = "cost",
    fixed: Sequence[str] = FIXED_POLICIES,
    cell: Sequence[str] = CELL,
) -> list[dict[str, Any]]:
    """Per cell (rows with the same values of the `cell` fields): `challenger`'s resumed TTFT
    (mean, p50, p99) over the best fixed policy's on each (1.05 = 5% slower), and its bytes
    moved over `offload`'s. Empty when the rows lack the challenger or every fixed policy."""
    cells: dict[tuple[Any, ...], dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        cells.setdefault(tuple(row[f] for f in cell), {})[row["policy"]] = row
    out = []
    for key, by_policy in cells.items():
        baselines = [by_policy[name] for name in fixed if name in by_policy]
        if challenger not in by_policy or not baselines:
            continue
        mine = by_policy[challenger]
        entry: dict[str, Any] = dict(zip(cell, key, strict=True))
        for field in RESUMED_FIELDS:
            best = min(baselines, key=lambda r: (r["failed"], r[field]))
            entry[field] = _ratio(mine[field], best[field])
            entry[f"{field}_best"] = best["policy"]
        if "offload" in by_policy:
            entry["bytes_vs_offload"] = _ratio(
                mine["bytes_moved"], by_policy["offload"]["bytes_moved"]
            )
        out.append(entry)
    return out


def _ratio(a: float, b: float) -> float:
    if b <= 0:
        return 1.0 if a <= 0 else math.inf
    return a / b


def _colour(winner: str, policies: Sequence[str]) -> int:
    return policies.index(winner) if "=" not in winner else len(policies)


def same(a: float, b: float) -> bool:
    """Within half a percent: not a difference the model can claim."""
    return abs(a - b) <= 0.005 * max(abs(a), abs(b))


def markdown(sweep: Mapping[str, Any]) -> str:
    head = ["hardware", "resume share", "context", "resumed turns"]
    lines = ["### Winners (margin over the best of the rest; a=b: within 0.5%)", ""]
    lines.append("| " + " | ".join(head + [label for _, label, _ in METRICS]) + " |")
    lines.append("|" + "---|" * (len(head) + len(METRICS)))
    for w in sweep["winners"]:
        cells = [w["hardware"], f"{w['resume_share']:g}", f"{w['context']:,}"]
        cells.append(f"{w['resumed_share']:.0%}")
        for field, _, _ in METRICS:
            best = w[field]
            margin = "-" if best["margin"] is None else f"{best['margin']:.0%}"
            cells.append(f"{best['policy']} ({margin})")
        lines.append("| " + " | ".join(cells) + " |")
    if sweep.get("versus"):
        lines += [
            "",
            f"### cost over the best fixed policy ({', '.join(FIXED_POLICIES)}): resumed TTFT",
            "",
        ]
        lines.append("| hardware | resume share | context | mean | p50 | p99 | bytes / offload's |")
        lines.append("|---|---|---|---|---|---|---|")
        for v in sweep["versus"]:
            cells = [v["hardware"], f"{v['resume_share']:g}", f"{v['context']:,}"]
            for field in RESUMED_FIELDS:
                cells.append(f"{v[field]:.2f} ({v[f'{field}_best']})")
            ratio = v.get("bytes_vs_offload")
            cells.append("-" if ratio is None else f"{ratio:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        worst = {f: max(v[f] for v in sweep["versus"]) for f in RESUMED_FIELDS}
        lines += [
            "",
            "worst cell: " + ", ".join(f"{f.split('_')[1]} {worst[f]:.2f}" for f in RESUMED_FIELDS),
        ]
    lines += ["", "### Every run", ""]
    fields = ["hardware", "resume", "context", "policy", "TTFT p50 ms", "TTFT p99 ms"]
    fields += ["resumed mean / p50 / p99 ms", "resumed on device"]
    fields += ["out tok/s", "GB read", "GB written", "failed"]
    lines.append("| " + " | ".join(fields) + " |")
    lines.append("|" + "---|" * len(fields))
    for r in sweep["rows"]:
        values = [r["hardware"], f"{r['resume_share']:g}", f"{r['context']:,}", r["policy"]]
        values += [f"{r['median_ttft_ms']:,.0f}", f"{r['p99_ttft_ms']:,.0f}"]
        values.append(" / ".join(f"{r[f]:,.0f}" for f in RESUMED_FIELDS))
        values.append(f"{r['resumed_on_device']:.0%}")
        values += [f"{r['output_throughput']:,.0f}", f"{r['bytes_read'] / 1e9:,.1f}"]
        values += [f"{r['bytes_written'] / 1e9:,.1f}", str(r["failed"])]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def write_sweep(sweep: Mapping[str, Any], out_dir: str | Path, plots: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.md"]
    paths[0].write_text(json.dumps(sweep, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(sweep), encoding="utf-8")
    if plots:
        paths.append(heatmap(sweep, out / "sweep_heatmap.png"))
    return paths


def heatmap(sweep: Mapping[str, Any], path: Path) -> Path:
    """Winner per cell (colour) with its margin, one row of panels per hardware profile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    grid = sweep["grid"]
    policies, shares, contexts = grid["policies"], grid["resume_shares"], grid["contexts"]
    shown = [m for m in METRICS if m[0] in ("median_ttft_ms", "p99_ttft_ms", "output_throughput")]
    # one colour per policy, grey for a tie between several
    colours = ListedColormap([*plt.get_cmap("tab10").colors[: len(policies)], "lightgrey"])
    fig, axes = plt.subplots(
        len(grid["hardware"]),
        len(shown),
        figsize=(4.2 * len(shown) + 1.2, 3.2 * len(grid["hardware"]) + 0.6),
        dpi=110,
        squeeze=False,
        layout="constrained",
    )
    by_cell = {(w["hardware"], w["resume_share"], w["context"]): w for w in sweep["winners"]}
    for row, hardware in enumerate(grid["hardware"]):
        for col, (field, label, higher) in enumerate(shown):
            ax = axes[row][col]
            best = [[by_cell[hardware, s, c][field] for c in contexts] for s in shares]
            codes = [[_colour(b["policy"], policies) for b in line] for line in best]
            image = ax.imshow(
                codes, cmap=colours, vmin=-0.5, vmax=len(policies) + 0.5, origin="lower"
            )
            for i, line in enumerate(best):
                for j, b in enumerate(line):
                    names = b["policy"].split("=")
                    text = "all tie" if len(names) == len(policies) else "/".join(names)
                    if b["margin"] is not None:
                        text += f"\n{'+' if higher else '-'}{b['margin']:.0%}"
                    ax.text(j, i, text, ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(contexts)), [f"{c:,}" for c in contexts])
            ax.set_yticks(range(len(shares)), [f"{s:g}" for s in shares])
            ax.set_xlabel("context tokens")
            ax.set_ylabel("resume share")
            ax.set_title(f"{hardware}: {label}")
    # which colour is which policy: one colour bar for all panels
    bar = fig.colorbar(image, ax=axes, ticks=range(len(policies) + 1), shrink=0.8)
    bar.ax.set_yticklabels([*policies, "tie"])
    bar.set_label("best policy")
    fig.savefig(path)
    plt.close(fig)
    return path
