"""KvtierPromMetrics: kvtier's series in vLLM's Prometheus /metrics.

vLLM builds this once in its front end (the API server's process, where /metrics is served)
through `KvtierConnector.build_prom_metrics`, and calls `observe` with each step's change of
kvtier's series (`series.py`), sent by the worker's connector and carried by vLLM from the
worker and engine-core processes. Counters add the change; gauges add it too, so that they
hold the sum of all changes: the value now.

The series are registered in prometheus_client's default registry, the one vLLM serves.
vLLM drops its own `vllm:` series before registering them again (a second stat logger in
the same process); kvtier's `kvtier:` ones are dropped here the same way, since registering
a name twice is an error. A key this kvtier does not know is left out, never an error:
metrics must not fail a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvtier.integrations.vllm.series import CATALOGUE, PREFIX, Series, parse_key, series_key
from kvtier.vocab import SOURCES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT


def unregister_kvtier_series() -> None:
    """Drop `kvtier:` collectors registered by an earlier stat logger in this process."""
    for collector in list(REGISTRY._collector_to_names):  # as vLLM's unregister_vllm_metrics
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        unregister_kvtier_series()
        self._families: dict[str, Any] = {}
        for series in CATALOGUE.values():
            names = [*labelnames, *series.labels]
            if series.kind == "counter":
                family = self._counter_cls(PREFIX + series.name, series.help, names)
            else:
                # with several API server processes each adds the changes it was sent
                family = self._gauge_cls(
                    PREFIX + series.name, series.help, names, multiprocess_mode="sum"
                )
            self._families[series.name] = family
        # from the start, at 0: every source (as kvtier serve shows them) and the series
        # without kvtier labels; a tier's series appear with the tier's first report
        keys = [series_key("prompt_tokens_by_source", source=source) for source in SOURCES]
        keys += [series.name for series in CATALOGUE.values() if not series.labels]
        for labelvalues in per_engine_labelvalues.values():
            for key in keys:
                self._child(key, labelvalues)

    def _child(self, key: str, labelvalues: list[object]) -> tuple[Series, Any] | None:
        parsed = parse_key(key)
        if parsed is None:
            return None
        series, kvtier_labels = parsed
        return series, self._families[series.name].labels(*labelvalues, *kvtier_labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, change in transfer_stats_data.items():
            if not isinstance(change, int | float) or not change:
                continue
            found = self._child(key, labelvalues)
            if found is None:
                continue
            series, child = found
            # `Deltas` sends a counter's rises only, so a counter's change is never negative
            if series.kind == "gauge" or change > 0:
                child.inc(change)
