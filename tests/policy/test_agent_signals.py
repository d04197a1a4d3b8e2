"""How a turn ended, the tool it called and the client's hints, as the policies use them: the
reuse key, the tracker's events, the predictor's hinted rows, and the agent baselines
(`continuum`, `close-lru`) beside `cost`."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvtier.policy.actions import Move
from kvtier.policy.close_lru import CloseAwareLruPolicy
from kvtier.policy.continuum import ContinuumPolicy
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.predictor import ReusePredictor
from kvtier.policy.tracker import Returned, TurnTracker
from kvtier.policy.view import PolicyView, SessionHints, SessionView, TierView, TurnView

GB = 10**9


def _ended(session: SessionView, end: str, tool: str | None = None, **hints) -> SessionView:
    """`session` with its last turn ended so, and the client's hints."""
    last = dataclasses.replace(session.turns[-1], end=end, tool=tool)
    return dataclasses.replace(
        session, turns=(*session.turns[:-1], last), hints=SessionHints(**hints)
    )


def test_the_reuse_key_is_that_of_the_turn_before_the_gap():
    turns = (
        TurnView(0.0, 100, 1.0, "tool_call", "run_tests"),
        TurnView(40.0, 50, 41.0, "answer"),
    )
    s = SessionView("s", tenant="t", app_class="agent", turns=turns, idle_since=41.0)
    assert s.reuse_key == ("t", "agent", "answer", None)
    assert s.key_after(0) == ("t", "agent", "tool_call", "run_tests")
    assert s.key_after(-1) == ("t", "agent", None, None)
    # the gap after the tool call is learned under the tool call's key, not the answer's
    tracker = TurnTracker(max_age_s=3600.0)
    first = dataclasses.replace(s, turns=turns[:1], idle_since=1.0)
    tracker.update(PolicyView((first,), ()), 2.0)
    events = tracker.update(PolicyView((s,), ()), 42.0)
    assert events == [Returned("s", ("t", "agent", "tool_call", "run_tests"), 39.0, 40.0)]


def test_the_predictor_takes_close_and_expected_return_over_what_it_learned(kv):
    predictor = ReusePredictor()
    for gap in (5.0, 6.0, 7.0) * 50:  # the class comes back within seconds
        predictor.record_gap(("default", "chat", None, None), gap)
    plain = kv.session("a", 256)
    closed = dataclasses.replace(kv.session("b", 256), hints=SessionHints(close=True))
    later = dataclasses.replace(kv.session("c", 256), hints=SessionHints(expect_return_s=300.0))
    table, rows = predictor.cdf_table([plain, closed, later])
    idle, horizon = np.zeros(3), np.full(3, 30.0)
    within_30 = predictor.p_reuse_rows(table, rows, idle, horizon)
    assert within_30[0] > 0.9  # as learned
    assert within_30[1] == 0.0  # closed: never back
    assert within_30[2] < 0.05  # expected in five minutes, not in thirty seconds
    within_20_min = predictor.p_reuse_rows(table, rows[2:], np.zeros(1), np.array([1200.0]))
    assert within_20_min[0] > 0.95


def _device_view(sessions, capacity_gb: float, **kwargs) -> PolicyView:
    used = sum(c.size_bytes for s in sessions for c in s.stored_chunks())
    tiers = (TierView("device", used, int(capacity_gb * GB)), TierView("host", 0, 100 * GB))
    return PolicyView(tuple(sessions), tiers, bytes_per_token=131_072, **kwargs)


def _moved(actions) -> set[str]:
    return {a.session_id for a in actions if isinstance(a, Move)}


def test_continuum_pins_a_turn_that_ended_in_a_tool_call_for_its_predicted_run(kv):
    # an agent whose tool runs (idle the longest) and a chat that answered (idle less):
    # LRU would demote the agent; continuum holds it for the tool's predicted run time
    agent = _ended(kv.session("agent", 4096, idle_since=0.0), "tool_call", "read_file")
    chat = _ended(kv.session("chat", 4096, idle_since=1.0), "answer")
    capacity = 1.0  # 8,192 tokens of 128 KB: over the 90% watermark
    policy = ContinuumPolicy()
    assert _moved(policy.decide(_device_view([agent, chat], capacity), 2.0)) == {"chat"}
    # past the prior TTL (5 s) the pin is gone and LRU takes the older agent first
    assert "agent" in _moved(policy.decide(_device_view([agent, chat], capacity), 30.0))
    # a tool it has seen run long is not pinned at all
    long_runs = ContinuumPolicy(max_ttl_s=60.0)
    for _ in range(8):
        long_runs.runs._record("read_file", 600.0)
    assert "agent" in _moved(long_runs.decide(_device_view([agent, chat], capacity), 2.0))
    # the client's expected return sets the pin instead: 1.5 x 2 s
    hinted = dataclasses.replace(agent, hints=SessionHints(expect_return_s=2.0))
    assert _moved(long_runs.decide(_device_view([hinted, chat], capacity), 2.0)) == {"chat"}
    assert "agent" in _moved(long_runs.decide(_device_view([hinted, chat], capacity), 3.5))


def test_continuum_learns_a_tools_run_time_from_the_gaps_after_its_calls():
    policy = ContinuumPolicy(quantile=0.5)
    for i in range(6):
        call = TurnView(0.0, 10, 1.0, "tool_call", "edit_file")
        # seen idle after the call, then back 2 + i s after it ended
        policy.runs.observe((SessionView(f"s{i}", turns=(call,), idle_since=1.0),))
        turns = (call, TurnView(1.0 + 2.0 + i, 10))
        policy.runs.observe((SessionView(f"s{i}", turns=turns, active=True),))
    assert policy.runs.quantile("edit_file", 0.5) == 4.5
    assert policy.runs.quantile("never_seen", 0.5) == policy.runs.prior_s


def test_continuums_pins_give_way_to_a_waiting_request(kv):
    agent = _ended(kv.session("agent", 4096, idle_since=0.0), "tool_call", "read_file")
    # the device is full and a request needs more than everything unpinned
    v = _device_view([agent], 0.6, reason="pressure", bytes_needed=int(0.6 * GB))
    assert _moved(ContinuumPolicy().decide(v, 1.0)) == {"agent"}


def test_close_lru_frees_a_closed_session_at_once_and_is_offload_otherwise(kv):
    closed = dataclasses.replace(kv.session("closed", 512), hints=SessionHints(close=True))
    open_ = kv.session("open", 512)
    v = _device_view([closed, open_], 100.0)  # plenty of room
    policy = CloseAwareLruPolicy()
    assert {a.session_id for a in kv.dropped(policy.decide(v, 1.0))} == {"closed"}
    assert not kv.changes(policy.decide(_device_view([open_], 100.0), 1.0))


def test_cost_drops_a_closed_session_before_one_that_may_return(kv):
    closed = dataclasses.replace(kv.session("closed", 2048), hints=SessionHints(close=True))
    other = kv.session("other", 2048)
    # room for one of the two on the device and none below: one must go
    tiers = (TierView("device", 4096 * 131_072, 3000 * 131_072),)
    v = PolicyView((closed, other), tiers, bytes_per_token=131_072)
    actions = CostPolicy(kv.slow_model()).decide(v, 5.0)
    assert {a.session_id for a in kv.dropped(actions)} == {"closed"}


def test_a_close_releases_a_pin_in_the_views_the_engine_and_simulator_build():
    from kvtier.sim.session import SimSession
    from kvtier.workload.model import Request

    request = Request("s/0", "s", 0, 0.0, "t", "chat", 10, 1, (), 16.0, [], None)
    session = SimSession(request, chunk_tokens=256)
    session.hints = SessionHints(pin=True)
    assert session.view().pinned
    session.hints = SessionHints(pin=True, close=True)
    session.changed()
    assert not session.view().pinned  # closed: the policies may drop it
