"""KvtierStats: the connector's figures through vLLM's connector-stats hooks.

The worker's connector reports each step the change of its series since the last report
(`series.py`); vLLM carries it to its front end, sums the steps of an interval with
`aggregate`, hands each step's change to `prom_metrics.KvtierPromMetrics` and logs
`reduce()` once per interval as its "KV Transfer metrics" line. The line shows the counters
that moved in the interval under their series keys (`prompt_tokens_by_source{source=host}`,
`restored_chunks`, `tier_errors{tier=disk,reason=io}`); gauges (a tier's used bytes) are on
/metrics only, where their value, not their change, is shown.
"""

from __future__ import annotations

from collections import Counter

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtier.integrations.vllm.series import parse_key


class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = Counter(self.data)
        merged.update(other.data)
        self.data = dict(merged)
        return self

    def reduce(self) -> dict[str, int | float]:
        line: dict[str, int | float] = {}
        for key, value in self.data.items():
            parsed = parse_key(key)
            if parsed is None or parsed[0].kind != "counter":
                continue
            shown = round(value, 3) if isinstance(value, float) else value
            if shown:  # a few microseconds of load wait are not worth a place on the line
                line[key] = shown
        return line

    def is_empty(self) -> bool:
        return not self.reduce()  # nothing for the line (a gauge's change is not shown)
