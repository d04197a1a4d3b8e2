"""Prometheus metrics, named like vLLM's (`vllm:` -> `kvtier:`), one registry per app."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.tenant_quota_evictions = Gauge(
            "kvtier:tenant_quota_evicted_blocks",
            "Blocks dropped to hold the tenant's quota.",
            mt,
            registry=r,
        )

    def observe_finished(self, tenant: str, out: RequestOutput, num_output_tokens: int) -> None:
        labels = (self.model_name, tenant)
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
        for t in tenants:
            self.tenant_cached_bytes.labels(name, t.tenant).set(t.cached_bytes)
            self.tenant_idle_bytes.labels(name, t.tenant).set(t.idle_bytes)
            self.tenant_quota_evictions.labels(name, t.tenant).set(t.quota_evictions)
        return generate_latest(self.registry)
