"""PNG figures comparing policies' runs. matplotlib is imported here only, with the file-only
Agg backend, so commands that do not plot start fast and nothing needs a display."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.results.records import RESTORE_SOURCES, STORE_TIERS, RunRecords

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_GB = 1e9
_MIN_TTFT_S = 1e-3  # the log axis starts here


def write_plots(
    runs: Sequence[RunRecords], document: Mapping[str, Any], out_dir: str | Path
) -> list[Path]:
    """Write the figures into `out_dir` (created if needed); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = {run["policy"]: run["summary"] for run in document["runs"]}
    figures: list[tuple[str, Callable[[Axes], None]]] = [
        ("ttft_cdf.png", lambda ax: _ttft_cdf(runs, ax)),
        ("resumed_ttft_by_source.png", lambda ax: _resumed_by_source(summaries, ax)),
        ("itl_p99.png", lambda ax: _itl_p99(summaries, ax)),
        ("bytes_moved.png", lambda ax: _bytes_moved(summaries, ax)),
    ]
    written = []
    for name, draw in figures:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        draw(ax)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        written.append(_save(fig, out / name))
        plt.close(fig)
    tiers = [t for t in ("device", *STORE_TIERS) if any(_has_tier(r, t) for r in runs)]
    if tiers:
        fig, axes = plt.subplots(len(tiers), 1, figsize=(7, 2.2 * len(tiers) + 0.8), dpi=110)
        for ax, tier in zip(np.atleast_1d(axes), tiers, strict=True):
            _occupancy(runs, tier, ax)
        fig.tight_layout()
        written.append(_save(fig, out / "tier_occupancy.png"))
        plt.close(fig)
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path)
    return path


def _ttft_cdf(runs: Sequence[RunRecords], ax: Axes) -> None:
    for run in runs:
        ttft = np.sort([r.ttft_s for r in run.requests if not r.failed])
        if len(ttft):
            share = np.arange(1, len(ttft) + 1) / len(ttft)
            ax.step(ttft.clip(min=_MIN_TTFT_S), share, where="post", label=run.policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1)
    ax.set_title("TTFT CDF per policy")
    ax.legend(loc="lower right")


def _resumed_by_source(summaries: Mapping[str, Mapping[str, Any]], ax: Axes) -> None:
    width = 0.8 / max(len(summaries), 1)
    x = np.arange(len(RESTORE_SOURCES))
    for i, (policy, s) in enumerate(summaries.items()):
        groups = [s["ttft_resumed_by_source"][source] for source in RESTORE_SOURCES]
        median = [g.get("median_ms", 0.0) / 1000 for g in groups]
        bars = ax.bar(x + i * width, median, width, label=f"{policy} (p50; dot p99)")
        seen = [k for k, g in enumerate(groups) if g["count"]]
        p99 = [groups[k]["p99_ms"] / 1000 for k in seen]
        colour = bars.patches[0].get_facecolor()
        ax.scatter(x[seen] + i * width, p99, color=colour, marker="o", s=12)
    ax.set_xticks(x + width * (len(summaries) - 1) / 2, RESTORE_SOURCES)
    ax.set_ylabel("resumed-turn TTFT (s)")
    ax.set_title("Resumed turns: TTFT by where their history came from")
    ax.legend(fontsize="small")


def _itl_p99(summaries: Mapping[str, Mapping[str, Any]], ax: Axes) -> None:
    policies = list(summaries)
    x = np.arange(len(policies))
    itl = [summaries[p]["p99_itl_ms"] for p in policies]
    stall = [summaries[p]["p99_stall_ms"] for p in policies]
    ax.bar(x - 0.2, itl, 0.4, label="p99 ITL")
    ax.bar(x + 0.2, stall, 0.4, label="p99 stall (longest gap per request)")
    ax.set_xticks(x, policies)
    ax.set_ylabel("ms")
    ax.set_title("Inter-token latency tail per policy")
    ax.legend()


def _bytes_moved(summaries: Mapping[str, Mapping[str, Any]], ax: Axes) -> None:
    labels = [f"{tier} {way}" for tier in STORE_TIERS for way in ("read", "written")]
    width = 0.8 / max(len(summaries), 1)
    x = np.arange(len(labels))
    for i, (policy, s) in enumerate(summaries.items()):
        values = [
            s["tier_bytes"].get(tier, {}).get(f"bytes_{way}", 0) / _GB
            for tier in STORE_TIERS
            for way in ("read", "written")
        ]
        ax.bar(x + i * width, values, width, label=policy)
    ax.set_xticks(x + width * (len(summaries) - 1) / 2, labels, rotation=30)
    ax.set_ylabel("GB")
    ax.set_title("Bytes moved per tier")
    ax.legend(fontsize="small")


def _has_tier(run: RunRecords, tier: str) -> bool:
    return any(tier in sample.used_bytes for sample in run.occupancy)


def _occupancy(runs: Sequence[RunRecords], tier: str, ax: Axes) -> None:
    for run in runs:
        t = [s.t_s for s in run.occupancy if tier in s.used_bytes]
        used = [s.used_bytes[tier] / _GB for s in run.occupancy if tier in s.used_bytes]
        ax.plot(t, used, label=run.policy, linewidth=1)
    capacity = next((r.tiers[tier].capacity_bytes for r in runs if tier in r.tiers), None)
    if capacity:
        ax.axhline(capacity / _GB, color="black", linestyle=":", linewidth=1)
    ax.set_ylabel(f"{tier} GB")
    ax.set_xlabel("time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", loc="upper right")
