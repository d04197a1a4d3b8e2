"""The cost policy on scenarios whose right answer is known, and its monotonicity."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policy.actions import Drop, Move
from kvtier.policy.cost_model import CostModel, CostProfile, Prices
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.metrics import Calibration
from kvtier.policy.predictor import ReusePredictor
from kvtier.policy.view import TIER_RANK, QueueView, TurnView

GB = 10**9
CAPACITY = {"device": 80 * GB, "host": 200 * GB}
DROPPED = len(TIER_RANK)  # a rank below every tier


class FixedPredictor(ReusePredictor):
    """Says the same probability for everyone, to set p directly."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def p_reuse(self, session: object, idle_s: float, horizon_s: float) -> float:
        return self.p


def ranks(kv, v, actions) -> dict[int, int]:
    """Tier rank of each chunk of the view's only session after `actions` (drop = lowest)."""
    where = kv.placement(v, actions)
    return {idx: DROPPED if tier is None else TIER_RANK[tier] for (_, idx), tier in where.items()}


def test_long_session_that_returns_soon_is_kept_or_offloaded(kv):
    # 6K tokens cost ~4 s to recompute here; the prior alone says a return within seconds is
    # plausible, so at no tick before it returns (20 s) may the KV be dropped
    policy = CostPolicy(kv.slow_model())
    v = kv.view([kv.session("a", 6144, idle_since=0.0)], CAPACITY, other_used={"device": 30 * GB})
    for now in (0.0, 5.0, 10.0, 15.0, 20.0):
        actions = policy.decide(v, now)
        assert not kv.dropped(actions), now
        v = kv.apply(v, actions)
    assert all(c.tier is not None for c in v.sessions[0].chunks)


def test_long_session_is_kept_when_its_class_is_known_to_return(kv):
    predictor = ReusePredictor()
    for gap in (12, 15, 18, 20, 22, 25) * 20:
        predictor.record_gap(("default", "chat", None, None), gap)
    policy = CostPolicy(kv.slow_model(), predictor)
    v = kv.view([kv.session("a", 6144)], CAPACITY, other_used={"device": 30 * GB})
    for now in (5.0, 10.0, 15.0):
        actions = policy.decide(v, now)
        assert not kv.changes(actions)  # plenty of room: stays on the device
        v = kv.apply(v, actions)


def _never_returns() -> ReusePredictor:
    predictor = ReusePredictor()
    for _ in range(500):
        predictor.record_no_return(("default", "oneshot", None, None))
    return predictor


def test_a_session_unlikely_to_return_keeps_a_tier_with_room_past_the_cut_off(kv):
    # dropping from a tier with room buys no latency and, the space being paid for anyway, no
    # money: a session of a class that almost never returns stays, before the cut-off age and
    # after it
    policy = CostPolicy(kv.slow_model(), _never_returns())
    s = kv.session("b", 200, app_class="oneshot")
    v = kv.view([s], CAPACITY, other_used={"device": 30 * GB})
    assert not kv.changes(policy.decide(v, 60.0))
    assert not kv.changes(policy.decide(v, policy.predictor.max_age_s + 1))


def test_short_session_that_never_returns_is_dropped_where_space_has_a_floor_price(kv):
    prices = Prices.from_dollars(floor_dollars_per_gb_hour=0.000008)  # 0.1% of host DRAM
    policy = CostPolicy(dataclasses.replace(kv.slow_model(), prices=prices), _never_returns())
    s = kv.session("b", 200, app_class="oneshot")
    v = kv.view([s], CAPACITY, other_used={"device": 30 * GB})
    assert kv.dropped(policy.decide(v, 60.0)) == [Drop("b", 0)]


def test_kv_idle_past_the_cut_off_age_stays_while_its_tier_has_room(kv):
    # the predictor counts it as never returning, but a drop from a device with room buys
    # nothing: it stays, on the timer and at every later decision
    policy = CostPolicy(kv.slow_model())
    s = kv.session("a", 6144)
    v = kv.view([s], CAPACITY)
    assert not kv.dropped(policy.decide(v, 30.0))
    for now in (3601.0, 3606.0, 7200.0, 86_400.0):
        assert not kv.changes(policy.decide(v, now)), now


def _full_device(kv, old, young):
    """Capacities where the device holds exactly `old` and `young`, with host to spare."""
    device = sum(c.size_bytes for s in (old, young) for c in s.chunks)
    return {"device": device, "host": 200 * GB}


def test_kv_idle_past_the_cut_off_age_is_the_first_victim_under_pressure(kv):
    # a device full of two idle sessions, asked for 400 MB: the session idle past the cut-off
    # gives it, leading chunks first, and they are dropped (the waiting request would wait
    # for their copies; the predictor gives them no chance to save anything); the session
    # that may still return keeps the device (chunk by chunk: the test counts chunks)
    policy = CostPolicy(kv.slow_model(), pricing_chunks=1)
    old, young = kv.session("old", 6144), kv.session("young", 6144, idle_since=3600.0)
    size = old.chunks[0].size_bytes
    v = kv.view([old, young], _full_device(kv, old, young), bytes_needed=400 * 10**6)
    actions = policy.decide(v, 3650.0)
    where = kv.placement(v, actions)
    assert not kv.changes(a for a in actions if a.session_id == "young")
    victims = [c.index for c in old.chunks if where["old", c.index] is None]
    assert victims == list(range(-(-400 * 10**6 // size)))  # just enough, from the front
    assert all(where["old", c.index] == "device" for c in old.chunks[len(victims) :])


def test_kv_idle_past_the_cut_off_age_makes_way_on_the_timer_to_a_lower_tier(kv):
    # the same device with requests waiting: on the timer nobody waits for a copy, and a
    # drop from a host with room buys nothing, so the session past the cut-off goes to host,
    # leading chunks first, before the session that may return gives anything
    policy = CostPolicy(kv.slow_model())
    old, young = kv.session("old", 6144), kv.session("young", 6144, idle_since=3600.0)
    queue = QueueView(waiting_requests=4, waiting_tokens=4 * 1024)
    v = kv.view([old, young], _full_device(kv, old, young), queue=queue)
    actions = policy.decide(v, 3650.0)
    where = kv.placement(v, actions)
    assert not kv.dropped(actions)
    moved = [c.index for c in old.chunks if where["old", c.index] == "host"]
    assert moved == list(range(len(moved))) and moved  # from the front
    if any(where["young", c.index] != "device" for c in young.chunks):
        assert len(moved) == len(old.chunks)


def test_kv_idle_past_the_cut_off_age_makes_way_in_a_full_lower_tier_oldest_first(kv):
    # host holds two sessions past the cut-off and has 0.39 GB free; a session that may return
    # is spilled there under pressure: the oldest idle past the cut-off makes way, leading
    # chunks first, and goes on down to disk, which has room
    capacity = {"device": 80 * GB, "host": 2 * GB, "disk": 100 * GB}
    older = kv.session("older", 6144, tier="host", idle_since=0.0)
    old = kv.session("old", 6144, tier="host", idle_since=100.0)
    young = kv.session("young", 6144, idle_since=3600.0)
    spill = sum(c.size_bytes for c in young.chunks)
    other = capacity["device"] - spill
    v = kv.view([older, old, young], capacity, other_used={"device": other}, bytes_needed=spill)
    actions = CostPolicy(kv.slow_model(), pricing_chunks=1).decide(v, 3800.0)  # counts chunks
    where = kv.placement(v, actions)
    assert not kv.dropped(actions)
    assert all(where["young", c.index] == "host" for c in young.chunks)
    assert all(where["old", c.index] == "host" for c in old.chunks)
    size = older.chunks[0].size_bytes
    short = spill - (capacity["host"] - 2 * len(older.chunks) * size)
    moved = [c.index for c in older.chunks if where["older", c.index] == "disk"]
    assert moved == list(range(-(-short // size)))
    assert all(where["older", c.index] == "host" for c in older.chunks[len(moved) :])


def test_scarce_device_and_long_queue_push_idle_kv_off_the_device(kv):
    policy = CostPolicy(kv.slow_model())
    s = kv.session("a", 6144)
    queue = QueueView(waiting_requests=20, waiting_tokens=20 * 4096)
    v = kv.view([s], CAPACITY, other_used={"device": 75 * GB}, queue=queue)
    actions = policy.decide(v, 5.0)
    where = kv.placement(v, actions)
    assert all(where["a", c.index] != "device" for c in s.chunks)
    # host has room and a load is far cheaper than a 4 s recompute: offloaded, not dropped
    assert all(where["a", c.index] == "host" for c in s.chunks)


def test_plenty_of_free_device_memory_keeps_kv_in_place(kv):
    policy = CostPolicy(kv.slow_model())
    v = kv.view([kv.session("a", 6144)], CAPACITY, other_used={"device": 10 * GB})
    assert not kv.changes(policy.decide(v, 5.0))


def test_values_kept_between_decisions_follow_the_prices_and_the_clock(kv):
    # the same session view on every call: its values are reused until something they were
    # priced at moves, so a policy that decided before must decide as a fresh one does
    s = kv.session("a", 6144, idle_since=0.0)
    roomy = kv.view([s], CAPACITY, other_used={"device": 10 * GB})
    queue = QueueView(waiting_requests=20, waiting_tokens=20 * 4096)
    crowded = kv.view([s], CAPACITY, other_used={"device": 75 * GB}, queue=queue)
    seasoned = CostPolicy(kv.slow_model())
    for now in (5.0, 10.0):
        assert not kv.changes(seasoned.decide(roomy, now))
    for v, now in ((crowded, 10.0), (roomy, 600.0), (roomy, 4000.0)):
        assert seasoned.decide(v, now) == CostPolicy(kv.slow_model()).decide(v, now), now
    # small steps of the clock and of the device's fill too: reuse is exact, never "close"
    # (the values a decision used are the ones pricing the session afresh gives)
    for step in range(40):
        now, other = 20.0 + 0.25 * step, (70 + step // 20) * GB
        v = kv.view([s], CAPACITY, other_used={"device": other}, queue=queue)
        assert seasoned.decide(v, now) == CostPolicy(kv.slow_model()).decide(v, now), now
        used = seasoned._state.priced("a")  # what this decision priced "a" at
        fresh = seasoned.value(v, s, now)
        assert [[fresh[i][t] for t in v.tier_names] for i in sorted(fresh)] == used.tolist()


def test_pressure_frees_at_least_the_bytes_asked_for(kv):
    policy = CostPolicy(kv.slow_model())
    sessions = [kv.session(f"s{i}", 4096) for i in range(4)]
    per_session = 4096 * kv.BYTES_PER_TOKEN
    need = 3 * per_session
    cap = {"device": 4 * per_session, "host": 2 * per_session}
    v = kv.view(sessions, cap, bytes_needed=need)
    after = kv.apply(v, policy.decide(v, 5.0))
    assert after.tier("device").free_bytes >= need


def test_drops_take_leading_chunks_first(kv):
    # a full device and a small host: the chunks that lose are the cheapest to recompute
    policy = CostPolicy(kv.slow_model(), FixedPredictor(0.5))
    s = kv.session("a", 8192)
    cap = {"device": 8192 * kv.BYTES_PER_TOKEN, "host": 4096 * kv.BYTES_PER_TOKEN}
    v = kv.view([s], cap, bytes_needed=8192 * kv.BYTES_PER_TOKEN)
    where = kv.placement(v, policy.decide(v, 5.0))
    kept = [idx for (_, idx), tier in sorted(where.items()) if tier is not None]
    assert kept == list(range(len(s.chunks) - len(kept), len(s.chunks)))
    assert 0 < len(kept) < len(s.chunks)


def test_pinned_and_ttl_held_sessions_are_not_touched(kv):
    policy = CostPolicy(kv.slow_model(), FixedPredictor(0.0))  # would drop everything
    pinned = kv.session("p", 1024, pinned=True)
    held = kv.session("t", 1024, ttl_s=100.0)
    v = kv.view([pinned, held], CAPACITY)
    assert policy.decide(v, 50.0) == []
    assert {a.session_id for a in policy.decide(v, 150.0)} == {"t"}


def test_priority_raises_the_value_of_a_session(kv):
    policy = CostPolicy(kv.slow_model(), FixedPredictor(0.02), pricing_chunks=1)
    v = kv.view([kv.session("a", 512)], CAPACITY)
    low = policy.value(v, v.sessions[0], 5.0)
    high = policy.value(v, dataclasses.replace(v.sessions[0], priority=2), 5.0)
    assert high[1]["device"] > low[1]["device"]


def test_calibration_records_one_prediction_per_idle_session(kv):
    calibration = Calibration()
    policy = CostPolicy(kv.slow_model(), calibration=calibration, horizon_s=5.0)
    s = kv.session("a", 512, idle_since=0.0)
    policy.decide(kv.view([s], CAPACITY), 1.0)
    back = dataclasses.replace(s, turns=(*s.turns, TurnView(3.0, 10)), active=True, idle_since=None)
    policy.decide(kv.view([back], CAPACITY), 4.0)
    assert calibration.resolved == 1
    assert calibration.reliability()[0].observed_rate == 1.0


# --- monotonicity ------------------------------------------------------------------------

occupancy = st.floats(0.0, 0.97)
probability = st.floats(0.0, 1.0)


def _placed(kv, *, tokens=4096, p=0.3, occupied=0.3, scale=1.0) -> dict[int, int]:
    profile = CostProfile(0.01, 5e-4 * scale, 5e-8 * scale)
    policy = CostPolicy(CostModel(profile), FixedPredictor(p))
    cap = {"device": 80 * GB, "host": 200 * GB, "disk": 1000 * GB}
    v = kv.view([kv.session("a", tokens)], cap, other_used={"device": int(occupied * 80 * GB)})
    return ranks(kv, v, policy.decide(v, 5.0))


@settings(max_examples=40, deadline=None)
@given(p=probability, q=probability, occupied=occupancy)
def test_likelier_return_is_placed_same_or_higher(kv, p, q, occupied):
    low, high = sorted((p, q))
    less, more = _placed(kv, p=low, occupied=occupied), _placed(kv, p=high, occupied=occupied)
    assert all(more[i] <= less[i] for i in less)


@settings(max_examples=40, deadline=None)
@given(a=st.integers(1, 24), b=st.integers(1, 24), p=probability, occupied=occupancy)
def test_longer_context_is_placed_same_or_higher(kv, a, b, p, occupied):
    short, long = sorted((a * 256, b * 256))
    shorter = _placed(kv, tokens=short, p=p, occupied=occupied)
    longer = _placed(kv, tokens=long, p=p, occupied=occupied)
    # chunk for chunk the same, and the longer context's last chunk is worth at least as much
    assert all(longer[i] <= shorter[i] for i in shorter)
    assert longer[max(longer)] <= shorter[max(shorter)]


@settings(max_examples=40, deadline=None)
@given(x=st.floats(0.1, 10), y=st.floats(0.1, 10), p=probability, occupied=occupancy)
def test_slower_compute_is_placed_same_or_higher(kv, x, y, p, occupied):
    fast, slow = sorted((x, y))
    quick = _placed(kv, scale=fast, p=p, occupied=occupied)
    sluggish = _placed(kv, scale=slow, p=p, occupied=occupied)
    assert all(sluggish[i] <= quick[i] for i in quick)


@settings(max_examples=40, deadline=None)
@given(x=occupancy, y=occupancy, p=probability)
def test_scarcer_device_memory_is_placed_same_or_lower(kv, x, y, p):
    roomy, tight = sorted((x, y))
    more_room = _placed(kv, occupied=roomy, p=p)
    less_room = _placed(kv, occupied=tight, p=p)
    assert all(less_room[i] >= more_room[i] for i in more_room)


def test_demotions_go_down_one_or_more_tiers_never_up(kv):
    policy = CostPolicy(kv.slow_model(), FixedPredictor(0.001))
    s = kv.session("a", 4096, tier="host")
    v = kv.view([s], {"device": 80 * GB, "host": 10 * GB, "disk": 100 * GB})
    for action in policy.decide(v, 5.0):
        if isinstance(action, Move):
            assert TIER_RANK[action.tier] > TIER_RANK["host"]


def test_sessions_still_idle_count_against_an_early_return(kv):
    # the finished gaps say "back within 20 s"; 40 sessions idle for 200 s say many never are:
    # a decision shows the policy both, so a session idle 50 s is not taken as due back
    predictor = ReusePredictor()
    for gap in (12, 15, 18, 20) * 30:
        predictor.record_gap(("default", "chat", None, None), gap)
    key = ("default", "chat", None, None)
    finished_only = predictor.p_reuse(key, 50.0, 150.0)
    policy = CostPolicy(kv.slow_model(), predictor)
    idle = [kv.session(f"old{i:02}", 256, tier="host", idle_since=0.0) for i in range(40)]
    v = kv.view([*idle, kv.session("new", 256, idle_since=150.0)], CAPACITY)
    policy.decide(v, 200.0)
    assert finished_only > 0.2
    assert policy.predictor.p_reuse(key, 50.0, 150.0) < 0.05


def test_pricing_some_chunks_in_place_gives_what_pricing_them_all_gives(kv):
    # a decision re-prices only the stale sessions' chunks, reading them where they are in
    # the table (`priced`): each must get exactly the value a pricing of every chunk gives it
    from kvtier.policy.cost_policy import _fresh_chunks

    policy = CostPolicy(kv.slow_model())
    sessions = [
        kv.session("a", 2048, idle_since=0.0),
        kv.session("b", 1024, tier="host", idle_since=-40.0),
        kv.session("c", 3072, idle_since=-300.0),
    ]
    v = kv.view(sessions, CAPACITY, other_used={"device": 50 * GB})
    chunks = _fresh_chunks(sessions)
    q, d = policy._schedules(sessions, np.array([s.idle_s(10.0) for s in sessions]))
    tiers = v.tier_names
    prices = policy._prices(tiers, {t: 0.5 for t in tiers})
    n = len(chunks.size)
    values, gain = np.empty((n, len(tiers))), np.empty((n, len(tiers)))
    policy._induction(chunks, q, d, prices, tiers, np.arange(n), values, gain)
    assert n == 24 and np.isfinite(values[:, -1]).all() and (gain[:, 0] != gain[:, -1]).any()
    priced = np.array([1, 5, 9, n - 1])  # chunks of all three sessions (8, 4 and 12 chunks)
    part_values = np.full((len(priced), len(tiers)), np.nan)
    part_gain = np.full((len(priced), len(tiers)), np.nan)
    at = np.arange(len(priced))
    policy._induction(chunks, q, d, prices, tiers, at, part_values, part_gain, priced)
    assert part_values.tolist() == values[priced].tolist()
    assert part_gain.tolist() == gain[priced].tolist()


def _learned(kv):
    """A policy whose predictor has learned two keys' gaps and 20 sessions' own ones, the
    sessions' distributions and their idle times: at 0, inside bin 0, on and between bin
    edges, near and past the cut-off."""
    from kvtier.policy.view import SessionView

    policy = CostPolicy(kv.slow_model())
    predictor = policy.predictor
    rng = np.random.default_rng(5)
    keys = (("t", "chat", None, None), ("t", "api", None, None))
    for i in range(40):
        for _ in range(5):
            gap = float(rng.lognormal(3.0, 1.5))
            predictor.record_gap(keys[i % 2], gap, session_id=f"s{i % 20}")
    sessions = [SessionView(f"s{i}", app_class=keys[i % 2][1], tenant="t") for i in range(30)]
    table, rows = predictor.cdf_table(sessions)
    edges = predictor.edges
    idle = np.concatenate(
        [[0.0, 0.5, edges[7], edges[7] + 1.0, 3599.0, 3600.0, 5000.0], rng.uniform(0, 4000, 23)]
    )
    return policy, table, rows, idle


def test_stepped_schedules_are_each_sessions_own_priced_in_numpy(kv):
    # `_schedule_rows` prices every session's grid in a compiled kernel after numpy's
    # logarithms: the same bits as numpy pricing each session's own copy of its grid
    policy, table, rows, idle = _learned(kv)
    predictor = policy.predictor
    q, d = policy._schedule_rows(table, rows, idle)
    starts, lengths = policy._grid(predictor.age_floor(idle))
    want = predictor.p_reuse_cdf(table[rows], starts, lengths)
    want[lengths <= 0] = 0.0
    lengths[predictor.age_floor(idle) >= predictor.max_age_s, 0] = policy.horizon_s
    assert q.tobytes() == want.tobytes() and d.tobytes() == lengths.tobytes()
    assert len(table) > 2 and q.max() > 0 and (q == 0).any()


def test_keepers_chance_of_return_within_their_stay_prices_only_the_intervals_it_covers(kv):
    # `_back_within` skips the intervals that start after the stay: each would add a factor
    # of exactly 1, so the answer is the whole schedule's, bit for bit
    from kvtier.policy.cost_policy import _return_within

    policy, table, rows, idle = _learned(kv)
    predictor = policy.predictor
    starts, d = policy._grid(idle)
    q = predictor.p_reuse_cdf(table[rows], starts, d)
    q[d <= 0] = 0.0
    d[idle >= predictor.max_age_s, 0] = policy.horizon_s
    for span in (policy.horizon_s, 40.0, 600.0, predictor.max_age_s):
        want = _return_within(q, d, span)
        got = policy._back_within(table, rows, idle, span)
        assert got.tobytes() == want.tobytes(), span
        assert 0 < want.max() <= 1
