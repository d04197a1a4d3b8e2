"""The figures the vLLM connector reports, named as `kvtier serve` names them on /metrics.

The worker's connector turns kvtier's report (`EngineTiers.stats()`) into running totals,
one per series and label set (`totals`), and sends vLLM the change since its last report
(`Deltas`); vLLM sums those changes for its logged stats line (`stats.py`) and adds them to
its Prometheus series (`prom_metrics.py`). Only what kvtier measures is reported.

A key is a series' name and its kvtier labels, written the way Prometheus writes them:
`prompt_tokens_by_source{source=host}`. Keys are plain strings so that vLLM can carry them
between its processes and sum them as they are; `parse_key` reads one back.

Names and labels are those of `kvtier serve` (`kvtier.server.metrics`) where serve has the
series, so one dashboard reads both; vLLM adds its own `model_name` and `engine` labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.cache.stats import TIER_TRAFFIC
from kvtier.vocab import SOURCES

PREFIX = "kvtier:"


@dataclass(frozen=True)
class Series:
    name: str  # without PREFIX
    kind: Literal["counter", "gauge"]
    labels: tuple[str, ...]  # kvtier's labels, after vLLM's
    help: str


_TIER = ("tier",)
CATALOGUE: dict[str, Series] = {
    s.name: s
    for s in (
        Series(
            "prompt_tokens_by_source",
            "counter",
            ("source",),
            "Prompt tokens by where their KV came from: device (vLLM's prefix cache), host, "
            "disk or remote (restored from a kvtier tier), recomputed.",
        ),
        Series(
            "restored_chunks", "counter", (), "Chunks loaded from kvtier's tiers into vLLM's KV."
        ),
        Series(
            "restore_failures",
            "counter",
            (),
            "Chunk loads that failed or came late (their tokens are recomputed).",
        ),
        Series(
            "load_seconds",
            "counter",
            (),
            "Seconds vLLM's steps waited for kvtier's loads before the forward.",
        ),
        Series(
            "written_through_chunks",
            "counter",
            (),
            "Full chunks copied out of vLLM's KV and written to the top tier.",
        ),
        Series("written_through_bytes", "counter", (), "Bytes of those chunks."),
        Series(
            "write_through_failures",
            "counter",
            (),
            "Chunk writes dropped (the write queue was full) or failed.",
        ),
        Series("tier_used_bytes", "gauge", _TIER, "Bytes a KV tier holds."),
        Series("tier_capacity_bytes", "gauge", _TIER, "A KV tier's budget in bytes."),
        Series("tier_chunks", "gauge", _TIER, "Chunks a KV tier holds."),
        *(Series(name, "counter", _TIER, text) for _, name, text in TIER_TRAFFIC),
        Series(
            "tier_errors",
            "counter",
            ("tier", "reason"),
            "Failed KV tier operations, by reason: no_space (filesystem full), io (another "
            "OS error), corrupt, rejected, failed (tier down, record gone), unexpected.",
        ),
        Series(
            "policy_decisions",
            "counter",
            ("policy", "decision"),
            "Retention policy decisions about paused sessions' KV, by kind.",
        ),
        # the connector's own: kvtier serve's engine holds its device blocks itself
        Series(
            "policy_runs",
            "counter",
            ("policy", "trigger"),
            "Retention policy runs, by trigger: timer, or pressure (vLLM's queue needs the "
            "blocks paused sessions hold).",
        ),
        Series(
            "policy_released_vllm_blocks",
            "counter",
            (),
            "vLLM blocks of paused sessions the policy ordered out of vLLM's prefix cache.",
        ),
    )
}

# the connector's counters reported as they are, under the same name
_CONNECTOR_COUNTERS = (
    "restored_chunks",
    "restore_failures",
    "written_through_chunks",
    "written_through_bytes",
    "write_through_failures",
    "policy_released_vllm_blocks",
)
# a tier's figures in kvtier's report -> its series
_TIER_FIGURES = {
    "used_bytes": "tier_used_bytes",
    "capacity_bytes": "tier_capacity_bytes",
    "chunks": "tier_chunks",
    **{field: name for field, name, _ in TIER_TRAFFIC},
}


def series_key(name: str, **labels: str) -> str:
    if name not in CATALOGUE or set(labels) != set(CATALOGUE[name].labels):
        raise ValueError(f"no series {name} with labels {sorted(labels)}")
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={labels[k]}" for k in CATALOGUE[name].labels) + "}"


def parse_key(key: str) -> tuple[Series, tuple[str, ...]] | None:
    """The series a key names and its label values in the catalogue's order; None for a key
    this kvtier does not know (reported by another version: left out, not an error)."""
    name, _, rest = key.partition("{")
    series = CATALOGUE.get(name)
    if series is None:
        return None
    pairs = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if "=" in p)
    if set(pairs) != set(series.labels):
        return None
    return series, tuple(pairs[label] for label in series.labels)


def totals(report: Mapping[str, Any]) -> dict[str, float]:
    """Every series' running total (a gauge: its value now) from kvtier's connector report."""
    out: dict[str, float] = {}
    tokens = report.get("tokens", {})
    for source in SOURCES:
        out[series_key("prompt_tokens_by_source", source=source)] = tokens.get(source, 0)
    counters = report.get("counters", {})
    for name in _CONNECTOR_COUNTERS:
        out[name] = counters.get(name, 0)
    out["load_seconds"] = report.get("load_seconds", 0.0)
    for tier, figures in report.get("tiers", {}).items():
        for field, name in _TIER_FIGURES.items():
            if field in figures:
                out[series_key(name, tier=tier)] = figures[field]
        for reason, count in figures.get("errors_by_reason", {}).items():
            out[series_key("tier_errors", tier=tier, reason=reason)] = count
    policy = str(report.get("policy", ""))
    for decision, count in report.get("decisions", {}).items():
        out[series_key("policy_decisions", policy=policy, decision=decision)] = count
    for trigger, count in report.get("policy_runs", {}).items():
        out[series_key("policy_runs", policy=policy, trigger=trigger)] = count
    return out


class Deltas:
    """The change of each total since the last report, the keys that changed only.

    A counter never goes down in Prometheus; kvtier's token counts may (tokens counted as
    restored become recomputed when a late layer fails, and the other way round). A counter
    below what was reported reports nothing until it is back above it, so vLLM's series
    follow kvtier's totals wherever they rise. A gauge reports every change, so the sum of
    its changes is its value."""

    def __init__(self) -> None:
        self._reported: dict[str, float] = {}

    def since_last(self, now: Mapping[str, float]) -> dict[str, float]:
        changed: dict[str, float] = {}
        for key, value in now.items():
            before = self._reported.get(key, 0)
            delta = value - before
            parsed = parse_key(key)
            if not delta or (delta < 0 and parsed is not None and parsed[0].kind == "counter"):
                continue
            changed[key] = delta
            self._reported[key] = value
        return changed
