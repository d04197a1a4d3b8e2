"""Validation arithmetic: relative error of simulated against measured figures, per policy."""

from __future__ import annotations

import pytest

from kvtier.errors import KvtierError
from kvtier.results.compare import compare
from kvtier.results.records import SCHEMA


def document(**policies):
    return {"schema": SCHEMA, "runs": [{"policy": p, "summary": s} for p, s in policies.items()]}


def test_relative_errors_per_policy():
    simulated = document(
        cost={"mean_ttft_ms": 110.0, "p99_itl_ms": 45.0, "request_throughput": 2.0,
              "tier_bytes": {"host": {"bytes_read": 0, "bytes_written": 300}}},
        retain={"mean_ttft_ms": 1.0},
    )  # fmt: skip
    measured = document(
        cost={"mean_ttft_ms": 100.0, "p99_itl_ms": 50.0, "request_throughput": 2.5,
              "tier_bytes": {"host": {"bytes_read": 0, "bytes_written": 0}}},
        offload={"mean_ttft_ms": 1.0},
    )  # fmt: skip
    result = compare(simulated, measured)
    assert list(result["policies"]) == ["cost"]
    cost = result["policies"]["cost"]
    assert cost["mean_ttft_ms"]["relative_error"] == pytest.approx(0.1)
    assert cost["p99_itl_ms"]["relative_error"] == pytest.approx(-0.1)
    assert cost["request_throughput"]["relative_error"] == pytest.approx(-0.2)
    assert cost["host_bytes_read"]["relative_error"] == 0.0  # both zero
    assert cost["host_bytes_written"]["relative_error"] is None  # measured zero, simulated not
    assert cost["mean_tpot_ms"] == {"simulated": None, "measured": None, "relative_error": None}
    assert (result["only_simulated"], result["only_measured"]) == (["retain"], ["offload"])


def test_other_files_are_refused():
    with pytest.raises(KvtierError, match="measured results have schema"):
        compare(document(), {"schema": "kvtier.plan/1"})
