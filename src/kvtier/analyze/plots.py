"""PNG figures of an Analysis. matplotlib is imported here only, with the file-only Agg
backend, so the command starts fast and runs without a display."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.analyze.metrics import Analysis
from kvtier.results.plots import log_time_axis

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# smallest gap drawn on the log axis: gaps of 0 (arrived before the estimated end) sit here
_MIN_GAP_S = 0.1


def write_plots(a: Analysis, out_dir: str | Path) -> list[Path]:
    """Write the figures into `out_dir` (created if needed); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("gaps_cdf.png", _gaps_cdf),
        ("turns_per_session.png", _turns_per_session),
        ("history_growth.png", _history_growth),
        ("idle_kv.png", _idle_kv),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        draw(a, ax)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _gaps_cdf(a: Analysis, ax: Axes) -> None:
    gaps = a.gaps_s.clip(min=_MIN_GAP_S)
    if len(gaps):
        ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post")
    ax.axvline(a.resume_after_s, color="tab:red", linestyle="--", label="resume threshold")
    log_time_axis(ax)
    ax.set_xlabel("idle gap before a returning turn (log scale)")
    ax.set_ylabel("share of returning turns")
    ax.set_ylim(0, 1)
    ax.set_title(f"Gap CDF ({len(gaps):,} returning turns)")
    ax.legend(loc="lower right")


def _turns_per_session(a: Analysis, ax: Axes) -> None:
    counts = sorted(Counter(a.turns_per_session.tolist()).items())
    ax.bar([n for n, _ in counts], [c for _, c in counts], width=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("turns in the session")
    ax.set_ylabel("sessions (log)")
    ax.set_title(f"Turns per session ({a.sessions:,} sessions)")


def _history_growth(a: Analysis, ax: Axes) -> None:
    turns = [row.turn for row in a.growth]
    # later turns come from fewer, often longer, sessions: show how many stand behind each mean
    counts = ax.twinx()
    counts.bar(turns, [row.requests for row in a.growth], color="lightgrey", width=0.8)
    counts.set_yscale("log")
    counts.set_ylabel("requests (log, bars)")
    ax.set_zorder(counts.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.plot(turns, [row.mean_prompt_tokens for row in a.growth], marker="o", label="prompt")
    ax.plot(turns, [row.mean_added_tokens for row in a.growth], marker=".", label="added")
    ax.set_xlabel("turn in the session")
    ax.set_ylabel("mean tokens")
    ax.set_title("History growth: prompt and tokens added since the previous turn")
    ax.legend(loc="upper left")


def _idle_kv(a: Analysis, ax: Axes) -> None:
    ax.step((a.idle_times_s - a.start_s) / 60, a.idle_bytes / 1e9, where="post")
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("GB")
    ax.set_title(f"KV of idle sessions that return ({a.kv.model}, {a.kv.kv_dtype})")
