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
    tiers = [t for t in ("device", *STORE_TIERS) if any(_holds(r, t) for r in runs)]
    if tiers:
        fig, axes = plt.subplots(
            len(tiers), 1, figsize=(8, 2.2 * len(tiers) + 0.8), dpi=110, layout="constrained"
        )
        for ax, tier in zip(np.atleast_1d(axes), tiers, strict=True):
            _occupancy(runs, tier, ax)
        # one legend beside the panels, where no line runs
        handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right upper", fontsize="small")
        written.append(_save(fig, out / "tier_occupancy.png"))
        plt.close(fig)
    return written


def log_time_axis(ax: Axes) -> None:
    """Make the x axis (seconds, already drawn) log-scaled with labels such as "5 ms", "200 ms",
    "3 s": decades only when the data spans many, finer steps when it spans few, so there are
    always a few labels and they never overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    low, high = ax.get_xlim()  # the data's limits on the log axis
    decades = np.log10(high / low) if low > 0 else 10.0
    subs = (1.0,) if decades > 3 else (1.0, 2.0, 5.0) if decades > 1 else (1, 1.5, 2, 3, 5, 7)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _seconds(value)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:,.3g} ms"
    return f"{value:,.3g} s" if value < 1000 else f"{value:,.0f} s"


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path)
    return path


def _ttft_cdf(runs: Sequence[RunRecords], ax: Axes) -> None:
    for run in runs:
        ttft = np.sort([r.ttft_s for r in run.requests if not r.failed])
        if len(ttft):
            share = np.arange(1, len(ttft) + 1) / len(ttft)
            ax.step(ttft.clip(min=_MIN_TTFT_S), share, where="post", label=run.policy)
    log_time_axis(ax)
    ax.set_xlabel("time to first token (log scale)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1)
    ax.set_title("TTFT CDF per policy")
    ax.legend(loc="lower right")


def _resumed_by_source(summaries: Mapping[str, Mapping[str, Any]], ax: Axes) -> None:
    # only the sources some policy's resumed turns came from: no empty disk/remote groups
    sources = [
        source
        for source in RESTORE_SOURCES
        if any(s["ttft_resumed_by_source"][source]["count"] for s in summaries.values())
    ]
    ax.set_title("Resumed turns: TTFT by where their history came from")
    if not sources:
        _nothing(ax, "no resumed turns")
        return
    width = 0.8 / max(len(summaries), 1)
    x = np.arange(len(sources))
    for i, (policy, s) in enumerate(summaries.items()):
        groups = [s["ttft_resumed_by_source"][source] for source in sources]
        median = [g.get("median_ms", 0.0) / 1000 for g in groups]
        bars = ax.bar(x + i * width, median, width, label=f"{policy} (p50; dot p99)")
        seen = [k for k, g in enumerate(groups) if g["count"]]
        p99 = [groups[k]["p99_ms"] / 1000 for k in seen]
        colour = bars.patches[0].get_facecolor()
        ax.scatter(x[seen] + i * width, p99, color=colour, marker="o", s=12)
    ax.set_xticks(x + width * (len(summaries) - 1) / 2, sources)
    ax.set_ylabel("resumed-turn TTFT (s)")
    ax.legend(fontsize="small")


def _nothing(ax: Axes, message: str) -> None:
    """An empty panel that says why, rather than bare axes."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


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
    tiers = moved_tiers(summaries)
    ax.set_title("Bytes moved per tier")
    if not tiers:
        _nothing(ax, "no tier moved any bytes")
        return
    labels = [f"{tier} {way}" for tier in tiers for way in ("read", "written")]
    width = 0.8 / max(len(summaries), 1)
    x = np.arange(len(labels))
    for i, (policy, s) in enumerate(summaries.items()):
        values = [_moved(s, tier, way) / _GB for tier in tiers for way in ("read", "written")]
        ax.bar(x + i * width, values, width, label=policy)
    ax.set_xticks(x + width * (len(summaries) - 1) / 2, labels)
    ax.set_ylabel("GB")
    ax.legend(fontsize="small")


def moved_tiers(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The tiers below the device that any policy read from or wrote to: a tier that moved
    nothing in every run (not configured, or never used) would only be an empty column."""
    return [
        tier
        for tier in STORE_TIERS
        if any(_moved(s, tier, way) for s in summaries.values() for way in ("read", "written"))
    ]


def _moved(summary: Mapping[str, Any], tier: str, way: str) -> int:
    return summary["tier_bytes"].get(tier, {}).get(f"bytes_{way}", 0)


def _holds(run: RunRecords, tier: str) -> bool:
    return any(sample.used_bytes.get(tier, 0) for sample in run.occupancy)


def _occupancy(runs: Sequence[RunRecords], tier: str, ax: Axes) -> None:
    for run in runs:
        t = [s.t_s for s in run.occupancy if tier in s.used_bytes]
        used = [s.used_bytes[tier] / _GB for s in run.occupancy if tier in s.used_bytes]
        ax.plot(t, used, label=run.policy, linewidth=1)
    capacity = next((r.tiers[tier].capacity_bytes for r in runs if tier in r.tiers), None)
    if capacity:
        ax.axhline(capacity / _GB, color="black", linestyle=":", linewidth=1)
    ax.set_ylabel(f"{tier} GB")
    ax.set_xlabel("trace time (s)")
    ax.grid(True, alpha=0.3)
