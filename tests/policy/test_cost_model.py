"""The cost model: recompute grows with position and adds up over chunks, fits recover known
coefficients, loads are affine in size, prices rise with occupancy."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.plan.geometry import load_geometry
from kvtier.plan.hardware import get_accelerator
from kvtier.plan.planner import prefill_flops, recompute_seconds
from kvtier.policy.cost_model import GB, CostModel, CostProfile, Prices, TierLink

PROFILE = CostProfile(prefill_fixed_s=0.02, prefill_token_s=3e-5, prefill_pair_s=1e-9)


def test_chunks_add_up_to_one_prefill_and_late_chunks_cost_more():
    model = CostModel(PROFILE)
    chunks = [model.chunk_recompute_s(256, start) for start in range(0, 8192, 256)]
    assert sum(chunks) + PROFILE.prefill_fixed_s == pytest.approx(model.recompute_s(8192, 0))
    assert chunks == sorted(chunks) and chunks[-1] > chunks[0]
    assert model.recompute_s(0, 100) == 0.0


def test_fit_recovers_prefill_coefficients():
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(50):
        tokens, pos = int(rng.integers(16, 4096)), int(rng.integers(0, 32768))
        seconds = 0.02 + 3e-5 * tokens + 1e-9 * tokens * (2 * pos + tokens) / 2
        samples.append((tokens, pos, seconds * (1 + rng.normal(0, 1e-3))))
    fitted = CostProfile.from_measurements(samples)
    assert fitted.prefill_fixed_s == pytest.approx(0.02, rel=0.05)
    assert fitted.prefill_token_s == pytest.approx(3e-5, rel=0.05)
    assert fitted.prefill_pair_s == pytest.approx(1e-9, rel=0.05)


def test_fit_never_returns_a_negative_coefficient():
    # times that shrink with length would need a < 0 somewhere; the fit drops that term
    fitted = CostProfile.from_measurements([(100, 0, 0.5), (200, 0, 0.4), (400, 0, 0.45)])
    coefficients = (fitted.prefill_fixed_s, fitted.prefill_token_s, fitted.prefill_pair_s)
    assert min(coefficients) >= 0


def test_fit_needs_enough_valid_measurements():
    with pytest.raises(KvtierError, match="3 measurements"):
        CostProfile.from_measurements([(100, 0, 0.1)])
    with pytest.raises(KvtierError, match="tokens > 0"):
        CostProfile.from_measurements([(0, 0, 0.1)] * 3)


def test_link_fit_recovers_latency_and_bandwidth_and_load_is_affine():
    link = TierLink.fit([(n, 2e-4 + n / 5e9) for n in (1e6, 1e7, 1e8, 1e9)])
    assert link.latency_s == pytest.approx(2e-4) and link.bandwidth == pytest.approx(5e9)
    model = CostModel(CostProfile(0, 0, 0, {"disk": link}))
    assert model.load_s(0, "disk") == pytest.approx(2e-4)
    assert model.load_s(10**9, "disk") == pytest.approx(2e-4 + 0.2)
    assert model.load_s(10**9, "device") == 0.0
    with pytest.raises(KvtierError, match="two sizes"):
        TierLink.fit([(1e6, 1e-3), (1e6, 2e-3)])
    with pytest.raises(KvtierError, match="no link for tier 'remote'"):
        model.load_s(1, "remote")


def test_profile_from_geometry_matches_the_planner():
    geometry, accelerator = load_geometry("llama-3.1-8b"), get_accelerator("h100-sxm")
    model = CostModel(CostProfile.from_geometry(geometry, accelerator, efficiency=0.5))
    planned = recompute_seconds(prefill_flops(geometry, 8000), accelerator, 1, 0.5)
    assert model.recompute_s(8000, 0) == pytest.approx(planned, rel=1e-9)


def test_holding_with_headroom_is_free_and_is_dear_when_full():
    prices = Prices.from_dollars()
    assert prices.rent_s_per_gb_hour["device"] == pytest.approx(45.0)  # $2.5/h over 80 GB
    device = [prices.per_byte_second("device", u) for u in (0.0, 0.4, 0.5, 0.7, 0.9, 1.0)]
    # a device with room charges no rent: its scarcity is priced by demand (the auction)
    assert device[0] == device[1] == device[2] == 0
    assert device == sorted(device) and 0 < device[3] < device[4] < device[-1] < float("inf")
    host = [prices.per_byte_second("host", u) for u in (0.0, 0.5, 0.95)]
    assert host[0] == host[1] == 0 < host[2]
    model = CostModel(PROFILE, prices)
    # an hour of 1 GB on the device at 90% costs rent x 0.4 / 0.1 seconds
    assert model.hold_cost(GB, "device", 3600, 0.9) == pytest.approx(45.0 * 4.0)


def test_a_configured_floor_is_charged_equally_in_every_tier_with_room():
    prices = Prices.from_dollars(floor_dollars_per_gb_hour=0.008)  # host DRAM's own price
    floor = prices.floor_s_per_gb_hour
    assert floor == pytest.approx(prices.rent_s_per_gb_hour["host"])
    with_room = {t: prices.per_byte_second(t, 0.0) for t in ("device", "host", "disk", "remote")}
    assert all(v == pytest.approx(floor / (GB * 3600)) for v in with_room.values())
    model = CostModel(PROFILE, prices)
    assert model.hold_cost(GB, "device", 3600, 0.9) == pytest.approx(45.0 * 4.0 + floor)


def test_bad_profiles_are_rejected():
    with pytest.raises(KvtierError):
        CostProfile(-1.0, 0, 0)
    with pytest.raises(KvtierError):
        TierLink(bandwidth=0)
