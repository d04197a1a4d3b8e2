"""The demand forecast, and the cost policy pricing device space by it: idle KV keeps a device
with room for free, and is demoted on the timer once forecast arrivals would need the space."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.demand import DemandForecast
from kvtier.policy.predictor import ReusePredictor
from kvtier.policy.view import SessionView, TurnView

GB = 10**9


def arrivals(kv, count: int, tokens: int, every_s: float) -> list[SessionView]:
    """`count` new sessions of `tokens` tokens each, one every `every_s` seconds, all running."""
    return [
        SessionView(f"new{i}", turns=(TurnView(i * every_s, tokens),), active=True)
        for i in range(count)
    ]


def feed(kv, forecast: DemandForecast, sessions: list[SessionView], every_s: float) -> float:
    """Show `forecast` one view per arrival, as a policy on a timer would; returns the time."""
    now = 0.0
    for i in range(len(sessions)):
        now = i * every_s
        forecast.observe(kv.view(sessions[: i + 1], {"device": 1000 * GB}), now)
    return now


def show_arrivals(kv, policy: CostPolicy, start_s: float) -> float:
    """Ten long new conversations (8K tokens), one every 2 s from `start_s`, each finished
    before the next, shown to `policy` on a roomy device so that its forecast expects more;
    returns the time of the last."""
    now = start_s
    for i in range(10):
        now = start_s + 2.0 * i
        arrived = SessionView(f"new{i}", turns=(TurnView(now, 8192),), active=True)
        policy.decide(kv.view([arrived], {"device": 1000 * GB, "host": 200 * GB}), now)
    return now


def test_no_arrivals_no_demand(kv):
    forecast = DemandForecast()
    forecast.observe(kv.view([kv.session("a", 4096)], {"device": 80 * GB}), 0.0)
    levels, tail = forecast.exceedance(5.0, 10.0)
    assert len(levels) == 0 and len(tail) == 0


def test_one_large_context_every_ten_seconds(kv):
    forecast = DemandForecast(window_s=120.0)
    size = 8192 * kv.BYTES_PER_TOKEN
    now = feed(kv, forecast, arrivals(kv, 13, 8192, 10.0), 10.0)
    levels, tail = forecast.exceedance(5.0, now)
    # Poisson(0.5) arrivals of exactly `size` in 5 s: at least one with probability 1 - e^-0.5
    below = levels < size
    assert tail[below][1:] == pytest.approx(1 - math.exp(-13 / 120 * 5), rel=0.05)
    assert tail[0] >= tail[-1] and tail[-1] < 0.05
    assert list(tail) == sorted(tail, reverse=True)


def test_the_byte_rate_is_what_arrivals_brought_over_the_window(kv):
    forecast = DemandForecast(window_s=120.0)
    assert forecast.byte_rate(5.0, 0.0) == 0.0
    now = feed(kv, forecast, arrivals(kv, 30, 8192, 10.0), 10.0)
    # the arrivals of the last 120 s (13, counting both ends), over 120 s
    assert forecast.byte_rate(5.0, now) == pytest.approx(13 * 8192 * kv.BYTES_PER_TOKEN / 120)


def test_arrivals_leave_the_window(kv):
    forecast = DemandForecast(window_s=30.0)
    now = feed(kv, forecast, arrivals(kv, 5, 4096, 1.0), 1.0)
    assert len(forecast.exceedance(5.0, now)[0]) > 0
    assert len(forecast.exceedance(5.0, now + 60.0)[0]) == 0


def test_a_turn_whose_history_is_on_the_device_brings_only_its_new_tokens(kv):
    forecast = DemandForecast(window_s=600.0)
    idle = kv.session("a", 8192, idle_since=0.0)
    forecast.observe(kv.view([idle], {"device": 80 * GB}), 1.0)
    back = SessionView(
        "a",
        turns=(*idle.turns, TurnView(10.0, 256)),
        chunks=idle.chunks,
        active=True,
    )
    forecast.observe(kv.view([back], {"device": 80 * GB}), 10.0)
    levels, tail = forecast.exceedance(5.0, 10.0)
    # arrivals of 256 tokens: needing the 4,096 tokens' worth a reload of the history would
    # take is all but impossible (sixteen of them in 5 s)
    assert tail[0] > 0.3
    assert levels[tail > 0.01].max() < 4096 * kv.BYTES_PER_TOKEN


def test_idle_kv_keeps_a_nearly_full_device_when_nothing_arrives(kv):
    policy = CostPolicy(kv.slow_model())
    sessions = [kv.session(f"s{i}", 8192, idle_since=0.0) for i in range(9)]
    capacity = {"device": 10 * 8192 * kv.BYTES_PER_TOKEN, "host": 200 * GB}
    v = kv.view(sessions, capacity)
    for now in (5.0, 10.0, 15.0, 20.0):
        assert not kv.changes(policy.decide(v, now))


def test_idle_kv_is_demoted_ahead_of_forecast_arrivals(kv):
    policy = CostPolicy(kv.slow_model())
    idle = [kv.session(f"s{i}", 8192, idle_since=0.0) for i in range(9)]
    capacity = {"device": 10 * 8192 * kv.BYTES_PER_TOKEN, "host": 200 * GB}
    # long new conversations arrive every 2 s, each finished before the next: the device has
    # room for one, and more are coming than the idle sessions (silent for minutes) will use
    now = 0.0
    for i in range(10):
        now = 300.0 + 2.0 * i
        arrived = SessionView(f"new{i}", turns=(TurnView(now, 8192),), active=True)
        v = kv.view([*idle, arrived], capacity)
        policy.decide(v, now)
    v = kv.view(idle, capacity)
    where = kv.placement(v, policy.decide(v, now + 1.0))
    demoted = {sid for (sid, _), tier in where.items() if tier == "host"}
    assert demoted, "the forecast should free device space before the next arrival"
    assert not any(tier is None for tier in where.values())  # offloaded, not dropped
    after = kv.apply(v, policy.decide(v, now + 1.0))
    assert after.tier("device").free_bytes >= 8192 * kv.BYTES_PER_TOKEN


def test_a_pressure_decision_also_frees_the_space_forecast_arrivals_will_need(kv):
    """The engine asks for the space one request needs now; arrivals forecast before the next
    decision bid for more, as on the timer: freeing only the need would call the policy again
    at the next arrival."""
    policy = CostPolicy(kv.slow_model())
    context = 8192 * kv.BYTES_PER_TOKEN
    idle = [kv.session(f"s{i}", 8192, idle_since=0.0) for i in range(9)]
    capacity = {"device": 10 * context, "host": 200 * GB}
    now = show_arrivals(kv, policy, 300.0)
    need = 2 * context  # one context is free: the request needs one more
    v = kv.view(idle, capacity, bytes_needed=need)
    actions = policy.decide(v, now + 1.0)
    after = kv.apply(v, actions)
    assert after.tier("device").free_bytes >= need + context
    assert not kv.dropped(actions)  # offloaded: host has room and a load beats a recompute


def test_under_pressure_kv_past_the_cut_off_is_dropped_up_to_the_shortage_and_demoted_beyond(kv):
    """A device full of a session idle past the cut-off and one that may return, asked for
    400 MB while arrivals are forecast: the old session gives the space, leading chunks first.
    What the waiting request needs is dropped (it would wait for the copies); what the policy
    frees beyond it for the arrivals goes to host, since nobody waits for it."""
    policy = CostPolicy(kv.slow_model(), pricing_chunks=1)  # counts chunks
    now = show_arrivals(kv, policy, 3630.0)
    old, young = kv.session("old", 6144), kv.session("young", 6144, idle_since=3600.0)
    device = sum(c.size_bytes for s in (old, young) for c in s.chunks)
    v = kv.view([old, young], {"device": device, "host": 200 * GB}, bytes_needed=400 * 10**6)
    where = kv.placement(v, policy.decide(v, now + 1.0))
    size = old.chunks[0].size_bytes
    dropped = [c.index for c in old.chunks if where["old", c.index] is None]
    demoted = [c.index for c in old.chunks if where["old", c.index] == "host"]
    assert dropped == list(range(-(-400 * 10**6 // size)))  # just the shortage, from the front
    assert demoted and demoted == list(range(len(dropped), len(dropped) + len(demoted)))


def test_the_device_keeps_the_session_due_back_within_the_time_its_space_stays_free(kv):
    """Arrivals of one 8K context every 30 s need one of two idle 8K sessions' space. `docqa`
    always comes back 15-30 s after a turn, so it is never back within the next 5 s; `chat`
    comes back within seconds one time in ten and otherwise never. Ranked by the next
    interval alone, `docqa` (about 0 against 0.1) is demoted; a byte kept stays about 30 s
    (one context's worth at one context per 30 s), within which `docqa` is all but certain
    to be back and `chat` is not."""
    rng = np.random.default_rng(0)
    predictor = ReusePredictor()
    predictor.record_gaps(("default", "docqa", None, None), rng.uniform(15.0, 30.0, 2000))
    predictor.record_gaps(
        ("default", "chat", None, None), [*rng.uniform(3.0, 6.0, 200), *[7200.0] * 1800]
    )
    policy = CostPolicy(kv.slow_model(), predictor=predictor)
    capacity = {"device": 2 * 8192 * kv.BYTES_PER_TOKEN, "host": 200 * GB}
    now = 0.0
    for i in range(10):  # each finished before the next, as new conversations
        now = 30.0 * i
        arrived = SessionView(f"new{i}", turns=(TurnView(now, 8192),), active=True)
        policy.decide(kv.view([arrived], {"device": 1000 * GB, "host": 200 * GB}), now)
    now += 2.0
    idle = [
        kv.session(name, 8192, idle_since=now - 2.0, app_class=name) for name in ("chat", "docqa")
    ]
    v = kv.view(idle, capacity)
    assert predictor.p_reuse(idle[0], 2.0, 5.0) > predictor.p_reuse(idle[1], 2.0, 5.0)
    where = kv.placement(v, policy.decide(v, now))
    tiers = {sid: {tier for (s, _), tier in where.items() if s == sid} for sid in ("chat", "docqa")}
    # the forecast's slices free a little more than one context: a tail of docqa goes too
    assert tiers["chat"] == {"host"}
    assert "device" in tiers["docqa"]
