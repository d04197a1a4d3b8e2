"""The usage split and the tier metrics, from what the engine reports on a finished request."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvtier.engine.outputs import EngineStats, RequestOutput
from kvtier.engine.request import RequestMetrics
from kvtier.server.metrics import ServerMetrics, prompt_token_sources, restore_source
from tests.server.serve_process import metric


def finished(sources: dict[str, int], prompt: int = 100, cached: int = 0) -> RequestOutput:
    times = RequestMetrics(arrival_time=10.0, token_times=[10.25, 10.3])
    times.prompt_token_sources = sources
    return RequestOutput(
        "r",
        [1],
        "x",
        True,
        "length",
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
        metrics=times,
    )


def test_without_tiers_the_prefix_cache_hit_is_the_device_share():
    sources = prompt_token_sources(finished({}, prompt=100, cached=32))
    assert sources == {"device": 32, "host": 0, "disk": 0, "remote": 0, "recomputed": 68}


def test_the_restore_source_is_the_tier_most_restored_tokens_came_from():
    split = {"device": 16, "host": 32, "disk": 64, "remote": 0, "recomputed": 4}
    assert restore_source(split) == "disk"
    assert restore_source({**split, "host": 64}) == "disk"  # a tie: the slower tier
    assert restore_source({**split, "host": 0, "disk": 0}) == "device"
    assert restore_source(dict.fromkeys(split, 0)) == "recomputed"


def test_resumed_turns_are_timed_by_source_and_tokens_counted_per_tier():
    metrics = ServerMetrics("smollm2")
    split = {"device": 16, "host": 0, "disk": 0, "remote": 128, "recomputed": 22}
    metrics.observe_finished("acme", finished(split), 1, turn_kind="resumed")
    metrics.observe_finished("acme", finished(split), 1, turn_kind="continuing")
    text = generate_latest(metrics.registry).decode()
    count = "kvtier:resumed_turn_ttft_seconds_count"
    assert metric(text, count, source="remote", tenant="acme") == 1  # the continuing one: not
    assert metric(text, "kvtier:prompt_tokens_by_source_total", source="remote") == 256


def test_tier_budgets_and_decisions_come_from_the_engine_stats():
    metrics = ServerMetrics("smollm2")
    tiers = {
        "policy": "cost",
        "decisions": {"keep": 3, "move": 2, "drop": 1},
        "tiers": {"host": {"used_bytes": 100, "capacity_bytes": 1000, "chunks": 2}},
    }
    stats = EngineStats(0, 0, 16, 0, 0, 0.0, 0, 0, 0, 0, 0, tiers=tiers)
    text = metrics.render(stats, []).decode()
    assert metric(text, "kvtier:tier_used_bytes", tier="host") == 100
    assert metric(text, "kvtier:tier_capacity_bytes", tier="host") == 1000
    assert metric(text, "kvtier:policy_decisions_total", policy="cost", decision="move") == 2


def test_tier_errors_are_counted_by_reason_every_reason_from_the_start():
    metrics = ServerMetrics("smollm2")
    tiers = {
        "tiers": {
            "host": {"used_bytes": 0, "capacity_bytes": 1000, "chunks": 0},
            "disk": {"errors_by_reason": {"no_space": 3}},
        }
    }
    stats = EngineStats(0, 0, 16, 0, 0, 0.0, 0, 0, 0, 0, 0, tiers=tiers)
    text = metrics.render(stats, []).decode()
    errors = "kvtier:tier_errors_total"
    assert metric(text, errors, tier="disk", reason="no_space") == 3
    assert f'{errors}{{model_name="smollm2",reason="io",tier="host"}} 0.0' in text


def test_tier_reads_and_writes_are_counted_in_bytes_and_seconds():
    metrics = ServerMetrics("smollm2")
    figures = {"bytes_read": 50, "read_seconds": 0.25, "bytes_written": 4096, "write_seconds": 0.5}
    tiers = {"tiers": {"host": {"used_bytes": 0, "capacity_bytes": 1000, "chunks": 0, **figures}}}
    stats = EngineStats(0, 0, 16, 0, 0, 0.0, 0, 0, 0, 0, 0, tiers=tiers)
    text = metrics.render(stats, []).decode()
    assert metric(text, "kvtier:tier_read_bytes_total", tier="host") == 50
    assert metric(text, "kvtier:tier_read_seconds_total", tier="host") == 0.25
    assert metric(text, "kvtier:tier_written_bytes_total", tier="host") == 4096
    assert metric(text, "kvtier:tier_write_seconds_total", tier="host") == 0.5
