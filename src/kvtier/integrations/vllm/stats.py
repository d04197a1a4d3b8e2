"""KvtierStats: the connector's counts through vLLM's connector-stats hooks.

vLLM collects `get_kv_connector_stats()` each step (from the scheduler-side connector too),
sums them with `aggregate` and logs `reduce()` per interval. Each report here is the change
since the last one of kvtier's counters that say what the connector did: prompt tokens
loaded per tier, write-through chunks and bytes, failed loads. kvtier's full report
(tiers, moves, policy decisions) stays in `EngineTiers.stats()`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.vocab import SOURCES

_COUNTERS = (
    "restored_chunks",
    "restore_failures",
    "written_through_chunks",
    "written_through_bytes",
    "write_through_failures",
)


def totals(report: dict[str, Any]) -> Counter[str]:
    """The running totals reported to vLLM, from kvtier's connector report."""
    counters = report["counters"]
    out: Counter[str] = Counter()
    for source in SOURCES:
        out[f"tokens_{source}"] = report["tokens"].get(source, 0)
    for name in _COUNTERS:
        out[name] = counters.get(name, 0)
    out["tier_errors"] = sum(t.get("errors", 0) for t in report["tiers"].values())
    return out


class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data)
        merged.update(other.data)
        self.data = dict(merged)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in self.data.items() if value}

    def is_empty(self) -> bool:
        return not any(self.data.values())
