"""Decision counters, prediction calibration and regret."""

from __future__ import annotations

import math

import pytest

from kvtier.policy.actions import Drop, Keep, Move
from kvtier.policy.metrics import Calibration, PolicyMetrics, Regret
from kvtier.policy.tracker import Returned


def test_counts_decisions_per_tier_and_bytes_moved(kv):
    v = kv.view(
        [kv.session("a", 512), kv.session("b", 256, tier="host")],
        {"device": 10**12, "host": 10**12},
    )
    metrics = PolicyMetrics()
    metrics.record(v, [Keep("a", 0), Move("a", 1, "host"), Drop("b")])
    chunk = 256 * kv.BYTES_PER_TOKEN
    assert metrics.decisions == {
        ("keep", "device"): 1,
        ("demote", "device"): 1,
        ("drop", "host"): 1,
    }
    assert metrics.bytes_moved == {("device", "host"): chunk}
    assert metrics.bytes_dropped == {"host": chunk}
    names = {name for name, _, _ in metrics.samples()}
    assert names == {
        "kvtier_policy_decisions_total",
        "kvtier_policy_moved_bytes_total",
        "kvtier_policy_dropped_bytes_total",
    }


def test_perfect_predictions_score_zero_and_coin_flips_a_quarter():
    sharp, vague = Calibration(), Calibration()
    for i in range(10):
        returns = i % 2 == 0
        sharp.predict(f"s{i}", 0.0, 10.0, 1.0 if returns else 0.0)
        vague.predict(f"s{i}", 0.0, 10.0, 0.5)
    events = [Returned(f"s{i}", ("t", "c"), 5.0, 5.0) for i in range(0, 10, 2)]
    for calibration in (sharp, vague):
        calibration.observe(events)
        calibration.expire(11.0)
    assert sharp.brier() == 0.0 and vague.brier() == pytest.approx(0.25)
    [middle] = vague.reliability()
    assert middle.count == 10 and middle.mean_predicted == 0.5 and middle.observed_rate == 0.5


def test_a_return_after_the_horizon_is_a_miss():
    calibration = Calibration()
    calibration.predict("s", 0.0, 5.0, 0.9)
    calibration.predict("s", 10.0, 5.0, 0.9)
    calibration.observe([Returned("s", ("t", "c"), 12.0, 12.0)])
    # the first prediction's window closed at 5 s, the second's covers 12 s
    assert calibration.resolved == 2
    assert calibration.brier() == pytest.approx((0.9**2 + 0.1**2) / 2)
    assert math.isnan(Calibration().brier())


def test_pending_predictions_are_bounded():
    calibration = Calibration(max_pending=3)
    for i in range(5):
        calibration.predict(f"s{i}", float(i), 100.0, 0.2)
    assert calibration.resolved == 2  # the two oldest were resolved as misses to make room


def test_regret_against_the_oracle():
    regret = Regret()
    regret.add(3.0, 1.0)
    regret.add(1.0, 1.0)
    assert regret.regret_s == 2.0 and regret.ratio == 2.0
    assert Regret().ratio == 1.0
