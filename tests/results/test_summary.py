"""summarize() on the hand-made run of conftest.py; every expected figure is worked out by hand
from vLLM's definitions (docstring of kvtier.results.summary)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.results.records import SCHEMA, RequestRecord
from kvtier.results.summary import summarize


def test_vllm_fields(run):
    s = summarize(run)
    assert s["schema"] == SCHEMA and s["policy"] == "offload"
    assert (s["completed"], s["failed"], s["duration"]) == (3, 1, 4.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (2400, 9)
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_throughput"] == pytest.approx(9 / 4)
    assert s["total_token_throughput"] == pytest.approx(2409 / 4)
    # TTFT 0.1, 0.3, 0.2 s
    assert s["mean_ttft_ms"] == pytest.approx(200)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(0.02 / 3))
    assert s["p90_ttft_ms"] == pytest.approx(280)  # 0.2 + 0.8 x (0.3 - 0.2)
    assert s["p99_ttft_ms"] == pytest.approx(298)
    # TPOT (0.5 - 0.1) / 4 and (0.5 - 0.3) / 2; the one-token request has none
    assert s["mean_tpot_ms"] == pytest.approx(100) and s["std_tpot_ms"] == pytest.approx(0)
    # E2EL 0.5, 0.5, 0.2 s
    assert s["mean_e2el_ms"] == pytest.approx(400) and s["median_e2el_ms"] == pytest.approx(500)


def test_itl_pools_every_gap(run):
    s = summarize(run)  # gaps: 0.1 x 4, 0.05, 0.15
    assert s["mean_itl_ms"] == pytest.approx(100)
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["std_itl_ms"] == pytest.approx(1000 * math.sqrt(0.005 / 6))
    assert s["p90_itl_ms"] == pytest.approx(125)  # position 4.5 of 6: between 0.1 and 0.15
    assert s["p99_itl_ms"] == pytest.approx(147.5)


def test_pooled_gaps_give_the_figures_of_the_expanded_list(run):
    expanded = [g for r in run.requests for g in (r.itl_s or ())]
    run.itl_pooled = [(0.1, 4), (0.05, 1), (0.15, 1)]
    for r in run.requests:
        r.itl_s = None
    pooled = summarize(run)
    for p, key in ((50, "median"), (90, "p90"), (99, "p99")):
        assert pooled[f"{key}_itl_ms"] == pytest.approx(1000 * np.percentile(expanded, p))
    assert pooled["std_itl_ms"] == pytest.approx(1000 * np.std(expanded))


def test_stalls_are_each_requests_longest_gap(run):
    s = summarize(run)  # 0.1 and 0.15; the one-token request has no gap
    assert s["mean_stall_ms"] == pytest.approx(125)
    assert s["p99_stall_ms"] == pytest.approx(149.5)
    run.requests[0].itl_s, run.requests[0].max_itl_s = None, 0.4  # a simulator's record
    assert summarize(run)["mean_stall_ms"] == pytest.approx(275)


def test_kvtier_breakdowns(run):
    s = summarize(run)
    kinds = s["ttft_by_turn_kind"]
    assert [kinds[k]["count"] for k in ("new", "continuing", "resumed")] == [1, 1, 1]
    assert kinds["continuing"]["mean_ms"] == pytest.approx(200)
    by_source = s["ttft_resumed_by_source"]
    assert by_source["host"]["count"] == 1 and by_source["host"]["p99_ms"] == pytest.approx(300)
    assert by_source["device"] == {"count": 0}
    [row] = s["resume_latency_by_context"]
    assert (row["min_tokens"], row["max_tokens"], row["count"]) == (1024, 2048, 1)
    assert s["tokens_recomputed"] == 256
    assert s["restored_tokens"] == {
        "device": 200, "host": 1500, "disk": 0, "remote": 0, "recomputed": 256
    }  # fmt: skip
    assert s["hit_rate"]["host"] == pytest.approx(1500 / 1956)
    assert sum(s["hit_rate"].values()) == pytest.approx(1.0)
    assert s["tier_bytes"]["host"]["bytes_read"] == 400
    assert s["policy_decisions"] == {"demote": {"device": 3}, "drop": {"host": 1}}


def test_an_empty_run_counts_as_zeros_like_vllm():
    from kvtier.results.records import RunRecords

    s = summarize(RunRecords("retain", 0.0, []))
    assert s["completed"] == 0 and s["request_throughput"] == 0.0
    assert s["mean_ttft_ms"] == 0.0 and s["p99_itl_ms"] == 0.0


def test_restore_source_is_the_largest_share_slower_on_ties():
    record = RequestRecord("a/1", "a", "t", 1, "resumed", 0.0, 10, 1)
    assert record.restore_source is None
    record.restored_tokens = {"device": 100, "disk": 100, "host": 50}
    assert record.restore_source == "disk"
    assert record.cached_tokens == 250 and record.history_tokens == 250
