"""The baseline policies' behaviour, and what every policy owes the contract: budgets kept,
protected sessions untouched, no promotions, deterministic output."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import KvtierError
from kvtier.policy.actions import Drop, Keep, Move
from kvtier.policy.close_lru import CloseAwareLruPolicy
from kvtier.policy.config import load_config
from kvtier.policy.continuum import ContinuumPolicy
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.ledger import BudgetError, Ledger
from kvtier.policy.offload import OffloadPolicy
from kvtier.policy.oracle import OraclePolicy
from kvtier.policy.recompute import RecomputePolicy
from kvtier.policy.retain import RetainPolicy
from kvtier.policy.ttl import TtlPolicy
from kvtier.policy.view import (
    TIER_RANK,
    TIERS,
    ChunkView,
    PolicyView,
    QueueView,
    SessionHints,
    SessionView,
    TierView,
    TurnView,
)
from kvtier.sim.holding import HoldingIndex

MB = 10**6


def all_policies(kv) -> list:
    arrivals = {f"s{i}": [30.0 * (i % 3) + 110.0] for i in range(0, 12, 2)}
    return [
        RetainPolicy(),
        RecomputePolicy(),
        OffloadPolicy(),
        TtlPolicy(),
        ContinuumPolicy(),
        CloseAwareLruPolicy(),
        CostPolicy(kv.slow_model()),
        OraclePolicy(arrivals),
    ]


# --- baselines -----------------------------------------------------------------------------


def test_retain_does_nothing_on_its_timer(kv):
    v = kv.view([kv.session("a", 1024), kv.session("b", 1024)], {"device": 10**12})
    assert RetainPolicy().decide(v, 1000.0) == []


def test_retain_drops_least_recently_used_front_chunks_under_pressure(kv):
    old = kv.session("old", 1024, idle_since=0.0)
    new = kv.session("new", 1024, idle_since=50.0)
    per_chunk = 256 * kv.BYTES_PER_TOKEN
    v = kv.view([new, old], {"device": 8 * per_chunk}, bytes_needed=2 * per_chunk)
    assert RetainPolicy().decide(v, 60.0) == [Drop("old", 0), Drop("old", 1)]


def test_retain_evicts_lower_priority_first(kv):
    vip = kv.session("vip", 512, idle_since=0.0, priority=1)
    anyone = kv.session("anyone", 512, idle_since=50.0)
    per_chunk = 256 * kv.BYTES_PER_TOKEN
    v = kv.view([vip, anyone], {"device": 4 * per_chunk}, bytes_needed=per_chunk)
    assert RetainPolicy().decide(v, 60.0) == [Drop("anyone", 0)]


def test_recompute_drops_every_idle_session_at_once(kv):
    running = kv.session("running", 512, idle_since=None)
    v = kv.view([kv.session("b", 512), kv.session("a", 512), running], {"device": 10**12})
    assert RecomputePolicy().decide(v, 0.5) == [Drop("a"), Drop("b")]


def test_offload_cascades_down_and_drops_at_the_bottom(kv):
    per_chunk = 256 * kv.BYTES_PER_TOKEN
    on_host = kv.session("h", 512, tier="host", idle_since=0.0)
    on_disk = kv.session("d", 256, tier="disk", idle_since=0.0)
    on_device = kv.session("g", 512, idle_since=10.0)
    cap = {"device": 2 * per_chunk, "host": 2 * per_chunk, "disk": 1 * per_chunk}
    v = kv.view([on_device, on_host, on_disk], cap, bytes_needed=per_chunk)
    actions = OffloadPolicy(watermark=1.0).decide(v, 20.0)
    # disk's LRU goes first (dropped), then host's LRU moves to disk, then the device's to host
    assert actions == [Drop("d", 0), Move("h", 0, "disk"), Move("g", 0, "host")]


def test_offload_keeps_tiers_below_their_watermark(kv):
    per_chunk = 256 * kv.BYTES_PER_TOKEN
    v = kv.view([kv.session("a", 2048)], {"device": 10 * per_chunk, "host": 100 * per_chunk})
    after = kv.apply(v, OffloadPolicy(watermark=0.5).decide(v, 1.0))
    assert after.tier("device").used_bytes <= 5 * per_chunk


def test_ttl_demotes_one_tier_per_ttl_and_drops_after_the_last(kv):
    policy = TtlPolicy(seconds={"device": 10, "host": 100})
    v = kv.view([kv.session("a", 256, idle_since=0.0)], {"device": 10**12, "host": 10**12})
    assert policy.decide(v, 5.0) == []
    assert policy.decide(v, 50.0) == [Move("a", 0, "host")]
    assert policy.decide(v, 200.0) == [Drop("a", 0)]


def test_ttl_override_replaces_the_device_ttl(kv):
    policy = TtlPolicy(seconds={"device": 10, "host": 100})
    s = kv.session("a", 256, idle_since=0.0, ttl_s=60.0)
    v = kv.view([s], {"device": 10**12, "host": 10**12})
    assert policy.decide(v, 30.0) == []
    assert policy.decide(v, 70.0) == [Move("a", 0, "host")]


def test_oracle_keeps_what_returns_soonest_and_drops_what_never_returns(kv):
    per_session = 512 * kv.BYTES_PER_TOKEN
    sessions = [kv.session(name, 512) for name in ("soon", "later", "never")]
    v = kv.view(sessions, {"device": 3 * per_session, "host": 3 * per_session})
    queue = QueueView(waiting_requests=1, waiting_tokens=2 * 512)
    v = dataclasses.replace(v, queue=queue)  # the queue needs two sessions' worth
    oracle = OraclePolicy({"soon": [10.0], "later": [100.0]})
    where = kv.placement(v, oracle.decide(v, 5.0))
    assert {where["soon", i] for i in (0, 1)} == {"device"}
    assert {where["later", i] for i in (0, 1)} == {"host"}
    assert {where["never", i] for i in (0, 1)} == {None}


def test_oracle_cannot_be_built_from_configuration(kv):
    config = load_config(policy="oracle")
    with pytest.raises(KvtierError, match="future arrivals"):
        OraclePolicy.from_config(config, kv.slow_model())


# --- the contract, for every policy ----------------------------------------------------------


@st.composite
def views(draw) -> tuple[PolicyView, float]:
    # late enough, some sessions are idle past the predictor's cut-off age (1 h)
    now = draw(st.sampled_from([100.0, 4000.0]))
    tiers = [t for t in TIERS if t == "device" or draw(st.booleans())]
    sessions = []
    for i in range(draw(st.integers(0, 10))):
        chunks = []
        for j in range(draw(st.integers(1, 5))):
            tier = draw(st.sampled_from([*tiers, None]))
            size = draw(st.integers(1, 8)) * MB
            access = draw(st.floats(0, now))
            chunks.append((j, tier, size, access))
        idle = draw(st.one_of(st.none(), st.floats(0, now)))
        # how the last turn ended and what the client hinted: the agent policies act on them
        end = draw(st.sampled_from([None, "answer", "tool_call"]))
        finished = idle if idle is not None else None
        turn = TurnView(0.0, 16, finished, end, "run" if end == "tool_call" else None)
        hints = SessionHints(
            close=draw(st.booleans()) and draw(st.booleans()),
            expect_return_s=draw(st.one_of(st.none(), st.floats(0.5, 600))),
        )
        sessions.append(
            SessionView(
                f"s{i}",
                app_class=draw(st.sampled_from(["chat", "agent"])),
                chunks=tuple(_chunk(j, tier, size, access) for j, tier, size, access in chunks),
                active=idle is None,
                idle_since=idle,
                pinned=draw(st.booleans()) and draw(st.booleans()),
                priority=draw(st.integers(-1, 1)),
                ttl_s=draw(st.one_of(st.none(), st.floats(1, 200))),
                turns=(turn,),
                hints=hints,
            )
        )
    used = dict.fromkeys(tiers, 0)
    for s in sessions:
        for c in s.stored_chunks():
            used[c.tier] += c.size_bytes
    tier_views = tuple(
        TierView(t, used[t] + draw(st.integers(0, 5)) * MB, used[t] + draw(st.integers(0, 20)) * MB)
        for t in tiers
    )
    pressure = draw(st.booleans())
    view = PolicyView(
        tuple(sessions),
        tier_views,
        QueueView(draw(st.integers(0, 5)), draw(st.integers(0, 100))),
        bytes_per_token=MB // 10,
        reason="pressure" if pressure else "timer",
        bytes_needed=draw(st.integers(0, 40)) * MB if pressure else 0,
    )
    return view, now


def _chunk(index, tier, size, access):
    return ChunkView(index, index * 16, (index + 1) * 16, tier, size, last_access=access)


@settings(max_examples=150, deadline=None)
@given(case=views())
def test_every_policy_keeps_budgets_protection_and_direction(kv, case):
    view, now = case
    for policy in all_policies(kv):
        actions = policy.decide(view, now)
        Ledger(view).apply_all(actions)  # raises BudgetError if a tier overflows mid-way
        protected = {s.session_id for s in view.sessions if s.protected(now)}
        sessions = {s.session_id: s for s in view.sessions}
        for action in actions:
            assert action.session_id not in protected, (policy.name, action)
            if isinstance(action, Move):
                source = next(
                    c.tier
                    for c in sessions[action.session_id].chunks
                    if c.index == action.chunk_idx
                )
                assert TIER_RANK[action.tier] > TIER_RANK[source], (policy.name, action)


@settings(max_examples=60, deadline=None)
@given(case=views(), seed=st.randoms(use_true_random=False))
def test_every_policy_is_deterministic_and_ignores_session_order(kv, case, seed):
    view, now = case
    shuffled = list(view.sessions)
    seed.shuffle(shuffled)
    other = dataclasses.replace(view, sessions=tuple(shuffled))
    for first, second in zip(all_policies(kv), all_policies(kv), strict=True):
        assert first.decide(view, now) == second.decide(other, now), first.name


@settings(max_examples=60, deadline=None)
@given(case=views(), seed=st.randoms(use_true_random=False))
def test_every_policy_decides_the_same_from_the_simulators_holding_index(kv, case, seed):
    view, now = case
    index = HoldingIndex()
    shuffled = list(view.sessions)
    seed.shuffle(shuffled)
    for session in shuffled:
        index.update(session)
    indexed = dataclasses.replace(view, holding=index.snapshot())
    for first, second in zip(all_policies(kv), all_policies(kv), strict=True):
        assert first.decide(view, now) == second.decide(indexed, now), first.name


def test_holding_index_follows_sessions_as_their_chunks_move(kv):
    index = HoldingIndex()
    a, b = kv.session("a", 600), kv.session("b", 300, tier="host")
    index.update(a)
    index.update(b)
    assert index.snapshot() == {"device": (a,), "host": (b,)}
    moved = dataclasses.replace(a, chunks=kv.chunks(600, "disk"))
    index.update(moved)
    assert index.snapshot() == {"host": (b,), "disk": (moved,)}
    index.forget("b")
    assert index.snapshot() == {"disk": (moved,)}
    view = kv.view([moved], {"device": kv.GB, "disk": kv.GB})
    assert view.holders("disk") == (moved,) and view.holders("device") == ()


def test_pressure_is_relieved_when_enough_is_movable(kv):
    per_chunk = 256 * kv.BYTES_PER_TOKEN
    sessions = [kv.session(f"s{i}", 1024, idle_since=float(i)) for i in range(4)]
    cap = {"device": 16 * per_chunk, "host": 8 * per_chunk}
    v = kv.view(sessions, cap, bytes_needed=6 * per_chunk)
    for policy in (
        RetainPolicy(),
        RecomputePolicy(),
        OffloadPolicy(),
        TtlPolicy(),
        CostPolicy(kv.slow_model()),
    ):
        after = kv.apply(v, policy.decide(v, 10.0))
        assert after.tier("device").free_bytes >= 6 * per_chunk, policy.name


def test_ledger_rejects_overfilling_and_unknown_chunks(kv):
    per_chunk = 256 * kv.BYTES_PER_TOKEN
    v = kv.view([kv.session("a", 512)], {"device": 2 * per_chunk, "host": per_chunk})
    with pytest.raises(BudgetError, match="host"):
        Ledger(v).apply_all([Move("a", None, "host")])
    with pytest.raises(BudgetError, match="no chunk 7"):
        Ledger(v).apply(Drop("a", 7))
    ledger = Ledger(v).apply_all([Keep("a"), Move("a", 0, "host"), Drop("a", 1)])
    assert ledger.free("device") == 2 * per_chunk and ledger.free("host") == 0


def test_ledger_accounts_for_a_change_of_form(kv):
    v = kv.view([kv.session("a", 256)], {"device": 10**12, "host": 10**12})
    ledger = Ledger(v).apply_all([Move("a", 0, "host", "int8")])
    full = 256 * kv.BYTES_PER_TOKEN
    # int8 with group-32 metadata: 1 + 4/32 bytes per element instead of 2
    assert ledger.used("host") == round(full * 1.125 / 2)
