"""Prometheus metrics, named like vLLM's (`vllm:` -> `kvtier:`), one registry per app; the
tier and policy figures (kvtier's own) come from the engine's stats at each scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.cache.stats import TIER_TRAFFIC
from kvtier.tiers.base import ERROR_REASONS
from kvtier.vocab import LOWER_TIERS, SOURCES

if TYPE_CHECKING:
    from kvtier.engine.engine import EngineStats, RequestOutput
    from kvtier.server.tenants import TenantCacheStats

# vLLM's buckets (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


RESTORED = LOWER_TIERS  # fastest first


def prompt_token_sources(out: RequestOutput) -> dict[str, int]:
    """Prompt tokens by where their KV came from, every source listed. Without tiers the
    engine reports none: device = the prefix-cache hit, the rest recomputed."""
    reported = out.metrics.prompt_token_sources if out.metrics is not None else {}
    if reported:
        return {source: int(reported.get(source, 0)) for source in SOURCES}
    cached = out.num_cached_tokens or 0
    sources = dict.fromkeys(SOURCES, 0)
    sources["device"], sources["recomputed"] = cached, out.num_prompt_tokens - cached
    return sources


def restore_source(sources: dict[str, int]) -> str:
    """The tier most of the restored tokens came from (ties: the slower one); device when
    nothing was restored but something hit on device; else recomputed."""
    tokens, _, tier = max((sources[tier], i, tier) for i, tier in enumerate(RESTORED))
    if tokens:
        return tier
    return "device" if sources["device"] else "recomputed"


class TierCollector:
    """Tier budgets and the policy's decision counts from the engine stats of the last
    scrape: the engine keeps the cumulative counts, so they are reported as they are."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.tiers: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.tiers is None:
            return
        labels = ["model_name", "tier"]
        used = GaugeMetricFamily("kvtier:tier_used_bytes", "Bytes a KV tier holds.", labels=labels)
        capacity = GaugeMetricFamily(
            "kvtier:tier_capacity_bytes", "A KV tier's budget in bytes.", labels=labels
        )
        chunks = GaugeMetricFamily("kvtier:tier_chunks", "Chunks a KV tier holds.", labels=labels)
        errors = CounterMetricFamily(
            "kvtier:tier_errors",
            "Failed KV tier operations, by reason: no_space (filesystem full), io (another "
            "OS error), corrupt, rejected, failed (tier down, record gone), unexpected.",
            labels=[*labels, "reason"],
        )
        traffic = [
            (field, CounterMetricFamily(f"kvtier:{name}", text, labels=labels))
            for field, name, text in TIER_TRAFFIC
        ]
        for tier, figures in self.tiers.get("tiers", {}).items():
            used.add_metric([self.model_name, tier], figures.get("used_bytes", 0))
            capacity.add_metric([self.model_name, tier], figures.get("capacity_bytes", 0))
            chunks.add_metric([self.model_name, tier], figures.get("chunks", 0))
            for field, family in traffic:
                family.add_metric([self.model_name, tier], figures.get(field, 0))
            counted = figures.get("errors_by_reason", {})
            for reason in ERROR_REASONS:  # every series exists from the start, at 0
                errors.add_metric([self.model_name, tier, reason], counted.get(reason, 0))
        decisions = CounterMetricFamily(
            "kvtier:policy_decisions",
            "Retention policy decisions about paused sessions' KV, by kind.",
            labels=["model_name", "policy", "decision"],
        )
        policy = str(self.tiers.get("policy", ""))
        for decision, count in self.tiers.get("decisions", {}).items():
            decisions.add_metric([self.model_name, policy, decision], count)
        yield from (used, capacity, chunks, *(family for _, family in traffic), errors, decisions)


class SessionCollector:
    """The engine's session tracker at the last scrape: the sessions it remembers, and those
    it forgot to hold its `max_sessions` (the engine's running count, reported as it is)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        tracked = GaugeMetricFamily(
            "kvtier:sessions_tracked",
            "Sessions the engine tracks (their turns, and their KV for the retention policy).",
            labels=["model_name"],
        )
        tracked.add_metric([self.model_name], self.stats.num_sessions)
        evicted = CounterMetricFamily(
            "kvtier:sessions_evicted",
            "Sessions forgotten, least recently active first, to hold the tracker's cap.",
            labels=["model_name"],
        )
        evicted.add_metric([self.model_name], self.stats.num_sessions_evicted)
        yield from (tracked, evicted)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        mt = ["model_name", "tenant"]
        self.num_requests_running = Gauge(
            "kvtier:num_requests_running", "Requests in the engine's running batch.", m, registry=r
        )
        self.num_requests_waiting = Gauge(
            "kvtier:num_requests_waiting", "Requests waiting to be scheduled.", m, registry=r
        )
        self.kv_cache_usage = Gauge(
            "kvtier:kv_cache_usage_perc",
            "Fraction of device KV blocks in use (1 = full).",
            m,
            registry=r,
        )
        self.kv_blocks_cached_idle = Gauge(
            "kvtier:kv_cache_idle_cached_blocks", "Idle cached blocks (hittable).", m, registry=r
        )
        self.num_preemptions = Gauge(
            "kvtier:num_preemptions", "Preemptions since start (engine counter).", m, registry=r
        )
        self.http_in_flight = Gauge(
            "kvtier:http_requests_in_flight", "Generation requests being served.", mt, registry=r
        )
        self.prefix_queries = Counter(
            "kvtier:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            mt,
            registry=r,
        )
        self.prefix_hits = Counter(
            "kvtier:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            mt,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvtier:prompt_tokens", "Prompt tokens processed.", mt, registry=r
        )
        self.generation_tokens = Counter(
            "kvtier:generation_tokens", "Tokens generated.", mt, registry=r
        )
        self.request_success = Counter(
            "kvtier:request_success",
            "Finished requests by finish reason.",
            ["model_name", "tenant", "finished_reason"],
            registry=r,
        )
        self.request_rejected = Counter(
            "kvtier:request_rejected",
            "Requests refused before generation, by HTTP status.",
            ["model_name", "tenant", "status"],
            registry=r,
        )
        self.session_hints = Counter(
            "kvtier:session_hints",
            "Requests carrying each session hint (close, expect_return_s, priority, pin, ttl_s).",
            ["model_name", "tenant", "hint"],
            registry=r,
        )
        self.session_pins_over_quota = Counter(
            "kvtier:session_pins_over_quota",
            "Pin hints whose session's blocks did not fit the tenant's device quota when the "
            "turn ended (left unpinned).",
            mt,
            registry=r,
        )
        self.ttft = Histogram(
            "kvtier:time_to_first_token_seconds",
            "Time to first token.",
            mt,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvtier:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            mt,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvtier:e2e_request_latency_seconds",
            "Arrival to last token.",
            mt,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.tenant_cached_bytes = Gauge(
            "kvtier:tenant_cached_kv_bytes",
            "Device bytes of cached KV a tenant filled.",
            mt,
            registry=r,
        )
        self.tenant_idle_bytes = Gauge(
            "kvtier:tenant_idle_cached_kv_bytes",
            "Of which idle (what the quota bounds).",
            mt,
            registry=r,
        )
        self.prompt_tokens_by_source = Counter(
            "kvtier:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: device (prefix cache), host, disk or "
            "remote (restored from a tier), recomputed.",
            ["model_name", "tenant", "source"],
            registry=r,
        )
        self.resumed_ttft = Histogram(
            "kvtier:resumed_turn_ttft_seconds",
            "Time to first token of resumed turns (a session back after a pause), by where "
            "most of the restored KV came from.",
            ["model_name", "tenant", "source"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tier_collector = TierCollector(model_name)
        r.register(self.tier_collector)
        self.session_collector = SessionCollector(model_name)
        r.register(self.session_collector)
        self.tenant_quota_evictions = Gauge(
            "kvtier:tenant_quota_evicted_blocks",
            "Blocks dropped to hold the tenant's quota.",
            mt,
            registry=r,
        )

    def observe_finished(
        self,
        tenant: str,
        out: RequestOutput,
        num_output_tokens: int,
        turn_kind: str | None = None,
    ) -> None:
        labels = (self.model_name, tenant)
        sources = prompt_token_sources(out)
        for source, tokens in sources.items():
            if tokens:
                self.prompt_tokens_by_source.labels(*labels, source).inc(tokens)
        self.request_success.labels(self.model_name, tenant, out.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(*labels).inc(out.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(num_output_tokens)
        if out.num_cached_tokens is not None:
            self.prefix_queries.labels(*labels).inc(out.num_prompt_tokens)
            self.prefix_hits.labels(*labels).inc(out.num_cached_tokens)
        metrics = out.metrics
        if metrics is None:
            return
        if metrics.ttft_s is not None:
            self.ttft.labels(*labels).observe(metrics.ttft_s)
            if turn_kind == "resumed":
                source = restore_source(sources)
                self.resumed_ttft.labels(*labels, source).observe(metrics.ttft_s)
        itl = self.itl.labels(*labels)
        for gap in metrics.itl_s:
            itl.observe(gap)
        if metrics.e2e_s is not None:
            self.e2e.labels(*labels).observe(metrics.e2e_s)

    def render(self, stats: EngineStats, tenants: list[TenantCacheStats]) -> bytes:
        name = self.model_name
        self.num_requests_running.labels(name).set(stats.num_running)
        self.num_requests_waiting.labels(name).set(stats.num_waiting)
        self.kv_cache_usage.labels(name).set(stats.kv_usage)
        self.kv_blocks_cached_idle.labels(name).set(stats.kv_blocks_cached_idle)
        self.num_preemptions.labels(name).set(stats.num_preemptions)
        self.tier_collector.tiers = stats.tiers
        self.session_collector.stats = stats
        for t in tenants:
            self.tenant_cached_bytes.labels(name, t.tenant).set(t.cached_bytes)
            self.tenant_idle_bytes.labels(name, t.tenant).set(t.idle_bytes)
            self.tenant_quota_evictions.labels(name, t.tenant).set(t.quota_evictions)
        return generate_latest(self.registry)
