"""The bill: recompute GPU time and GB-hours per tier, priced in dollars."""

from __future__ import annotations

import pytest

from kvtier.policy.cost_model import CostModel, CostProfile
from kvtier.results.bill import bill
from kvtier.results.records import OccupancySample, RequestRecord, RunRecords

GB = 10**9
# 1 ms per token, nothing per pair: recomputing n tokens takes n ms of one replica
MODEL = CostModel(CostProfile(prefill_fixed_s=0.5, prefill_token_s=1e-3, prefill_pair_s=0.0))


def _request(session: str, turn: int, arrival: float, finish: float, recomputed: int):
    return RequestRecord(
        f"{session}/{turn}",
        session,
        "t",
        turn,
        "resumed" if turn else "new",
        arrival,
        1000,
        10,
        finish_s=finish,
        restored_tokens={"recomputed": recomputed} if recomputed else {},
    )


def test_a_run_is_billed_for_recompute_and_for_what_each_tier_held():
    run = RunRecords(
        "cost",
        7200.0,
        [
            _request("a", 0, 0.0, 10.0, 0),
            _request("a", 1, 3000.0, 3600.0, 2000),  # 2 s of recompute on 4 GPUs: 8 GPU-s
            _request("b", 0, 0.0, 1800.0, 0),
        ],
        occupancy=[
            OccupancySample(0.0, {"device": 10 * GB, "host": 0}),
            OccupancySample(3600.0, {"device": 10 * GB, "host": 20 * GB}),
            OccupancySample(7200.0, {"device": 0, "host": 20 * GB}),
        ],
    )
    money = bill(run, MODEL, 4, gpu_dollars_per_hour=3.6, dollars_per_gb_hour={"host": 0.01})
    assert money.recompute_gpu_s == pytest.approx(8.0)  # the per-call 0.5 s is not history's
    assert money.recompute_dollars == pytest.approx(8.0 / 3600 * 3.6)
    # trapezoids: device 10 GB for an hour then falling to 0 over the next: 15 GB-hours
    assert money.gb_hours == pytest.approx({"device": 15.0, "host": 30.0})
    assert money.holding_dollars == pytest.approx({"device": 0.0, "host": 0.3})
    assert money.session_hours == pytest.approx(1.5)  # a: 0 to 3600 s, b: 0 to 1800 s
    assert money.per_million_prompt_tokens == pytest.approx(money.dollars / 3000 * 1e6)
    assert money.per_session_hour == pytest.approx(money.dollars / 1.5)


def test_the_verdict_puts_a_measured_run_beside_its_projection():
    """money_notes writes the bill where the verdict reads it; the verdict has a row per
    policy, and side by side two (measured, projected) for the policies both ran."""
    from kvtier.policy.config import PolicyConfig
    from kvtier.results.bill import money_notes
    from kvtier.results.report import to_document
    from kvtier.results.verdict import side_by_side, verdict

    def document(policies, token_s):
        runs = [
            RunRecords(
                name, 3600.0, [_request("a", 0, 0.0, 1.0, 0), _request("a", 1, 60.0, 61.0, n)]
            )
            for name, n in policies
        ]
        for run in runs:
            for record in run.requests:
                record.first_token_s = record.arrival_s + 0.5
        notes = {run.policy: {} for run in runs}
        profile = CostProfile(prefill_fixed_s=0.0, prefill_token_s=token_s, prefill_pair_s=0.0)
        for run in runs:
            lines = money_notes(notes[run.policy], run, profile, PolicyConfig(), None)
            assert lines[0].startswith(f"{run.policy}: bill: recompute")
        return to_document("bench", {"runs": notes}, runs)

    measured = document([("retain", 4000), ("offload", 0)], 1e-3)
    projected = document([("offload", 0), ("retain", 4000), ("oracle", 0)], 1e-5)
    _, header, rows = verdict(measured, "here")
    assert [row[0] for row in rows] == ["retain", "offload"]
    assert rows[0][header.index("recomputed tok")] == "4,000"
    assert rows[0][header.index("recompute s")] == "4.0"  # 4,000 tokens at 1 ms
    _, header, rows = side_by_side(measured, projected, ("here", "70B"))
    assert [row[:2] for row in rows] == [
        ["retain", "here"], ["", "70B"], ["offload", "here"], ["", "70B"]
    ]  # fmt: skip
    assert rows[1][header.index("recompute s")] == "0.0"  # 4,000 tokens at 10 µs: 0.04 s
