"""The figures the vLLM connector reports (they need no vLLM): series keys read back, running
totals from kvtier's report under kvtier serve's names, and the per-step changes vLLM adds to
its Prometheus series (a counter never goes down)."""

from __future__ import annotations

import pytest

from kvtier.cache.stats import TIER_TRAFFIC
from kvtier.integrations.vllm.series import Deltas, parse_key, series_key, totals


def report(host_tokens: int = 256, recomputed: int = 30, used: int = 100) -> dict:
    return {
        "policy": "cost",
        "tokens": {"device": 0, "host": host_tokens, "recomputed": recomputed},
        "counters": {
            "restored_chunks": 2,
            "written_through_bytes": 4096,
            "policy_released_vllm_blocks": 5,
            "other": 7,
        },
        "tiers": {
            "host": {
                "used_bytes": used,
                "capacity_bytes": 1000,
                "chunks": 1,
                "bytes_read": 50,
                "read_seconds": 0.25,
                "bytes_written": 4096,
                "write_seconds": 0.5,
                "errors_by_reason": {"io": 1},
            }
        },
        "decisions": {"offload": 3},
        "policy_runs": {"timer": 1, "pressure": 2},
        "load_seconds": 0.125,
    }


def test_a_key_names_its_series_and_labels_and_reads_back():
    key = series_key("tier_errors", tier="disk", reason="no_space")
    assert key == "tier_errors{tier=disk,reason=no_space}"
    series, labels = parse_key(key)
    assert (series.name, series.kind, labels) == ("tier_errors", "counter", ("disk", "no_space"))
    assert parse_key("restored_chunks")[1] == ()
    assert parse_key("not_a_series") is None  # another kvtier version's key: left out
    assert parse_key("tier_errors{tier=disk}") is None
    with pytest.raises(ValueError):
        series_key("tier_errors", tier="disk")


def test_totals_name_what_kvtier_measured_as_serve_does():
    now = totals(report())
    assert now["prompt_tokens_by_source{source=host}"] == 256
    assert now["prompt_tokens_by_source{source=disk}"] == 0  # every source, always
    assert now["restored_chunks"] == 2 and now["written_through_bytes"] == 4096
    assert now["load_seconds"] == 0.125
    assert now["tier_read_bytes{tier=host}"] == 50
    assert now["tier_write_seconds{tier=host}"] == 0.5
    assert now["tier_errors{tier=host,reason=io}"] == 1
    assert now["policy_decisions{policy=cost,decision=offload}"] == 3
    # the connector's own: the policy's runs by trigger, the vLLM blocks it released
    assert now["policy_runs{policy=cost,trigger=pressure}"] == 2
    assert now["policy_released_vllm_blocks"] == 5
    assert not any(key.startswith("other") for key in now)  # only the catalogue's series
    # a tier's reads and writes carry serve's series names
    for field, name, _ in TIER_TRAFFIC:
        assert now[series_key(name, tier="host")] == report()["tiers"]["host"][field]


def test_changes_are_sent_once_counters_only_rise_gauges_follow():
    deltas = Deltas()
    first = deltas.since_last(totals(report()))
    assert first["prompt_tokens_by_source{source=host}"] == 256
    assert first["tier_used_bytes{tier=host}"] == 100
    assert "prompt_tokens_by_source{source=disk}" not in first  # unchanged (0): not sent
    assert deltas.since_last(totals(report())) == {}
    # a late layer failed: 128 tokens counted from host are recomputed; the tier emptied
    moved = deltas.since_last(totals(report(host_tokens=128, recomputed=158, used=40)))
    assert moved == {
        "prompt_tokens_by_source{source=recomputed}": 128,
        "tier_used_bytes{tier=host}": -60,
    }
    # host's series shows its total again once the count rises past what was reported
    assert deltas.since_last(totals(report(host_tokens=200, recomputed=158, used=40))) == {}
    later = deltas.since_last(totals(report(host_tokens=384, recomputed=158, used=40)))
    assert later == {"prompt_tokens_by_source{source=host}": 128}
