"""The reuse predictor learns known gap distributions, estimates P(no return), and starts from
its prior; the tracker turns views into what it learns from."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from kvtier.policy.predictor import GapPrior, Key, ReusePredictor
from kvtier.policy.running_gaps import RunningGaps
from kvtier.policy.tracker import Abandoned, Returned, TurnTracker
from kvtier.policy.view import PolicyView, SessionView, TierView, TurnView
from kvtier.policy.view_diff import Changes

KEY = ("tenant", "chat", None, None)


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))


@pytest.mark.parametrize("idle", [0.0, 10.0, 60.0, 180.0])
@pytest.mark.parametrize("horizon", [5.0, 30.0, 120.0])
def test_converges_to_an_exponential_gap_distribution(idle, horizon):
    predictor = ReusePredictor()
    predictor.record_gaps(KEY, np.random.default_rng(1).exponential(60.0, 20_000))
    expected = 1 - math.exp(-horizon / 60.0)  # memoryless: the same at every idle time
    assert predictor.p_reuse(KEY, idle, horizon) == pytest.approx(expected, abs=0.03)


@pytest.mark.parametrize("idle", [5.0, 60.0, 600.0])
def test_converges_to_a_lognormal_gap_distribution(idle):
    median, sigma, horizon = 120.0, 1.0, 60.0
    predictor = ReusePredictor()
    rng = np.random.default_rng(2)
    predictor.record_gaps(KEY, rng.lognormal(math.log(median), sigma, 20_000))
    cdf = lambda x: _phi((math.log(x) - math.log(median)) / sigma)  # noqa: E731
    expected = (cdf(idle + horizon) - cdf(idle)) / (1 - cdf(idle))
    assert predictor.p_reuse(KEY, idle, horizon) == pytest.approx(expected, abs=0.03)


def test_estimates_the_share_of_sessions_that_never_return():
    predictor = ReusePredictor()
    rng = np.random.default_rng(3)
    for _ in range(5000):
        if rng.random() < 0.3:
            predictor.record_no_return(KEY)
        else:
            predictor.record_gap(KEY, float(rng.exponential(30.0)))
    assert predictor.p_no_return(KEY) == pytest.approx(0.3, abs=0.02)
    # long after the typical gap, almost everyone still idle is one who will not return
    assert predictor.p_reuse(KEY, 600.0, 600.0) < 0.02


def test_prior_stands_in_before_data():
    prior = GapPrior()
    predictor = ReusePredictor(prior=prior)
    tail = (1 - prior.no_return) * (1 - _phi(math.log(3600 / 60) / prior.sigma))
    assert predictor.p_no_return(KEY) == pytest.approx(prior.no_return + tail, rel=1e-6)
    # 80% of returns within 10 minutes, by construction of sigma
    returned = 1 - prior.no_return
    assert predictor.p_reuse(KEY, 0.0, 600.0) == pytest.approx(0.8 * returned, abs=0.01)
    # heavy tail: the longer a session has been idle, the less likely it returns soon
    soon = [predictor.p_reuse(KEY, idle, 10.0) for idle in (0.0, 10.0, 100.0, 1000.0)]
    assert soon == sorted(soon, reverse=True)


def test_nothing_returns_past_the_cut_off_age():
    predictor = ReusePredictor(max_age_s=600.0)
    assert predictor.p_reuse(KEY, 600.0, 10.0) == 0.0
    predictor.record_gap(KEY, 900.0)  # longer than the cut-off: counts as never returned
    assert predictor.p_no_return(KEY) > ReusePredictor(max_age_s=600.0).p_no_return(KEY)


def test_keys_learn_separately_and_new_keys_start_from_the_pool():
    predictor = ReusePredictor()
    fast, slow = ("t", "agent"), ("t", "chat")
    for _ in range(2000):
        predictor.record_gap(fast, 3.0)
        predictor.record_gap(slow, 300.0)
    assert predictor.p_reuse(fast, 0.0, 10.0) > 0.9
    assert predictor.p_reuse(slow, 0.0, 10.0) < 0.1
    newcomer = predictor.p_reuse(("other", "x", None, None), 0.0, 10.0)
    assert newcomer == pytest.approx(0.5, abs=0.05)  # half the pooled sessions return in 3 s


def test_a_key_backs_off_to_the_same_key_across_tenants_before_the_pool():
    # agent traffic: most gaps are tool calls back in seconds; after an answer an agent comes
    # back in minutes or never. A tenant with few answers of its own is predicted like the
    # other tenants' answers, not like the traffic's majority.
    predictor = ReusePredictor()
    rng = random.Random(3)
    answer_a, answer_b = ("a", "agent", "answer", None), ("b", "agent", "answer", None)
    for _ in range(3000):
        predictor.record_gap(("a", "agent", "tool_call", "read_file"), rng.uniform(0.2, 2.0))
    for _ in range(100):
        predictor.record_gap(answer_a, rng.uniform(120.0, 600.0))
        predictor.record_no_return(answer_a)
    for gap in (300.0, 200.0):
        predictor.record_gap(answer_b, gap)
    pooled = ("b", "search", None, None)  # a class never seen: the pooled distribution
    assert predictor.p_reuse(pooled, 0.0, 10.0) > 0.8  # the majority's seconds
    assert predictor.p_reuse(answer_b, 0.0, 10.0) < 0.06
    # half of tenant a's agents never came back after an answer; b's two came back
    assert 0.3 < predictor.p_no_return(answer_b) < 0.5
    assert predictor.p_no_return(pooled) < 0.1
    # a tenant never seen starts from the others' answers too
    assert predictor.p_reuse(("c", "agent", "answer", None), 0.0, 10.0) < 0.06


def test_a_level_of_one_tenant_is_not_counted_twice():
    # while one tenant has a key's class and end, its gaps back off to the pool directly, as
    # if there were no level across tenants; a second tenant makes the level count
    one, two = ReusePredictor(), ReusePredictor()
    key = ("a", "chat", None, None)
    for gap in (5.0, 40.0, 300.0, 1200.0) * 20:
        one.record_gap(key, gap)
        two.record_gap(key, gap)
    two.record_gap(("b", "chat", None, None), 3000.0)
    one.record_gap(("b", "code", None, None), 3000.0)  # the same pooled data, another class
    level = one._distribution(key)
    pooled = np.diff(one._distribution(None)[0])
    histogram = one._keys[key]
    weight = one.prior.weight
    want = np.cumsum((histogram.counts + weight * pooled) / (histogram.total + weight))
    assert level[0][1:].tobytes() == want.tobytes()
    assert two._distribution(key)[0].tobytes() != level[0].tobytes()


def test_memory_is_bounded_by_max_keys():
    predictor = ReusePredictor(max_keys=2)
    for _ in range(200):
        predictor.record_gap(("t", "a", None, None), 3.0)
    predictor.record_gap(("t", "b", None, None), 300.0)
    predictor.record_gap(
        ("t", "c", None, None), 300.0
    )  # evicts ("t", "a"), the least recently updated
    assert predictor.p_reuse(("t", "a", None, None), 0.0, 10.0) == predictor.p_reuse(
        ("new", "x", None, None), 0.0, 10.0
    )


def test_accepts_a_session_or_a_key():
    predictor = ReusePredictor()
    session = SessionView("s", tenant="tenant", app_class="chat")
    assert predictor.p_reuse(session, 5.0, 5.0) == predictor.p_reuse(KEY, 5.0, 5.0)


# --- tracker ----------------------------------------------------------------------------------


def _view(*sessions: SessionView) -> PolicyView:
    return PolicyView(sessions, (TierView("device", 0, 1),))


def test_tracker_reports_returns_once_and_abandonment_once():
    tracker = TurnTracker(max_age_s=100.0)
    first = TurnView(arrival=0.0, prompt_tokens=10, finished=2.0)
    idle = SessionView("s", tenant="tenant", app_class="chat", turns=(first,), idle_since=2.0)
    assert tracker.update(_view(idle), 5.0) == []  # history before first sight is not news
    second = TurnView(arrival=12.0, prompt_tokens=10)
    back = dataclasses.replace(idle, turns=(first, second), active=True, idle_since=None)
    assert tracker.update(_view(back), 13.0) == [Returned("s", KEY, 10.0, 12.0)]
    assert tracker.update(_view(back), 14.0) == []
    done = dataclasses.replace(
        back,
        turns=(first, dataclasses.replace(second, finished=15.0)),
        active=False,
        idle_since=15.0,
    )
    assert tracker.update(_view(done), 50.0) == []
    assert tracker.update(_view(done), 120.0) == [Abandoned("s", KEY, 115.0)]
    assert tracker.update(_view(done), 200.0) == []
    # a return after being counted as abandoned is not counted again as a gap
    third = TurnView(arrival=300.0, prompt_tokens=10)
    late = dataclasses.replace(done, turns=(*done.turns, third), active=True, idle_since=None)
    assert tracker.update(_view(late), 301.0) == []


def test_tracker_forgets_sessions_that_leave_the_view():
    tracker = TurnTracker(max_age_s=100.0)
    s = SessionView("s", turns=(TurnView(0.0, 1, 1.0),), idle_since=1.0)
    tracker.update(_view(s), 2.0)
    tracker.update(_view(), 3.0)
    s2 = dataclasses.replace(s, turns=(*s.turns, TurnView(5.0, 1)), active=True, idle_since=None)
    assert tracker.update(_view(s2), 6.0) == []  # seen afresh: its history is not news


def test_tracker_abandons_by_the_idle_period_not_by_the_view():
    # an idle session's view changes whenever a policy moves its chunks; the cut-off counts
    # from when it went idle, once, and a return starts a new idle period
    tracker = TurnTracker(max_age_s=100.0)
    first = TurnView(arrival=0.0, prompt_tokens=10, finished=2.0)
    idle = SessionView("s", tenant="tenant", app_class="chat", turns=(first,), idle_since=2.0)
    tracker.update(_view(idle), 3.0)
    for now in (10.0, 20.0, 30.0):  # a new view object each time: chunks moved
        assert tracker.update(_view(dataclasses.replace(idle)), now) == []
    second = TurnView(arrival=50.0, prompt_tokens=10, finished=60.0)
    again = dataclasses.replace(idle, turns=(first, second), idle_since=60.0)
    assert tracker.update(_view(again), 61.0) == [Returned("s", KEY, 48.0, 50.0)]
    # 102 s is past the first idle period's cut-off, not the second's
    assert tracker.update(_view(dataclasses.replace(again)), 102.0) == []
    assert tracker.update(_view(again), 150.0) == []
    assert tracker.update(_view(dataclasses.replace(again)), 161.0) == [Abandoned("s", KEY, 160.0)]
    assert tracker.update(_view(again), 300.0) == []


def _session(session_id: str, key=KEY) -> SessionView:
    return SessionView(session_id, tenant=key[0], app_class=key[1])


def test_a_sessions_own_rhythm_counts_where_sessions_keep_one():
    # one key, two kinds of session: loops back every ~3 s, and people back after ~5 minutes
    predictor = ReusePredictor()
    rng = np.random.default_rng(4)
    for _turn in range(6):
        for i in range(100):
            gap = (3.0 if i % 2 else 300.0) * float(rng.lognormal(0.0, 0.2))
            predictor.record_gap(KEY, gap, session_id=f"s{i}")
    fast, slow = _session("s1"), _session("s0")
    assert predictor.personal(fast) and predictor.personal(slow)
    soon = lambda s: float(predictor.p_reuse_many(s, np.array([0.0]), np.array([10.0]))[0])  # noqa: E731
    assert soon(fast) > 0.7 and soon(slow) < 0.2
    # the key alone would say about half for both
    assert 0.3 < predictor.p_reuse(KEY, 0.0, 10.0) < 0.7


def test_a_sessions_past_is_ignored_where_gaps_are_drawn_independently():
    predictor = ReusePredictor()
    rng = np.random.default_rng(5)
    for _turn in range(6):
        for i in range(100):
            gap = (3.0 if rng.random() < 0.5 else 300.0) * float(rng.lognormal(0.0, 0.2))
            predictor.record_gap(KEY, gap, session_id=f"s{i}")
    assert not predictor.personal(_session("s1"))


def test_session_memory_is_bounded():
    predictor = ReusePredictor(max_sessions=10, session_gaps=3)
    for i in range(50):
        for _ in range(5):
            predictor.record_gap(KEY, 3.0, session_id=f"s{i}")
    assert len(predictor._sessions) == 10
    assert all(len(gaps) == 3 for gaps in predictor._sessions.values())


def test_age_floor_steps_at_the_bin_edges():
    predictor = ReusePredictor(max_age_s=3600.0, min_gap_s=1.0, bins=64)
    edges = predictor.edges
    ages = np.array([0.0, 0.5, edges[5], (edges[5] + edges[6]) / 2, edges[6] - 1e-9, 3600.0, 9e9])
    floor = predictor.age_floor(ages)
    assert floor.tolist() == [0.0, 0.0, edges[5], edges[5], edges[5], 3600.0, 3600.0]
    # conditioning on the floor moves a schedule in steps: the same within a bin
    within = predictor.p_reuse_many(
        ("t", "chat", None, None), predictor.age_floor(ages[2:5]), np.full(3, 5.0)
    )
    assert within[0] == within[1] == within[2]


def _learned_distributions(seed: int):
    """A predictor after gaps of two keys, some sessions with gaps of their own, and the
    distribution table of 60 sessions: (predictor, table, each session's row, the rng)."""
    predictor = ReusePredictor()
    rng = np.random.default_rng(seed)
    for i in range(40):
        for _ in range(4):
            key = KEY if i % 2 else ("tenant", "api")
            predictor.record_gap(key, float(rng.lognormal(3.0, 1.5)), session_id=f"s{i}")
    sessions = [_session(f"s{i}", KEY if i % 2 else ("tenant", "api")) for i in range(60)]
    table, rows = predictor.cdf_table(sessions)
    return predictor, table, rows, rng


def test_p_reuse_rows_reads_the_same_numbers_as_the_gathered_rows():
    # the next interval's chance read entry by entry equals p_reuse_cdf on whole gathered
    # rows, bit for bit, at ages in bin 0, inside and on bin edges, near and past the cut-off
    predictor, table, rows, rng = _learned_distributions(7)
    edges = predictor.edges
    idle = np.concatenate(
        [[0.0, 0.5, edges[7], 3599.0, 3600.0, 5000.0], rng.uniform(0.0, 4000.0, len(rows) - 6)]
    )
    horizon = np.minimum(idle + 5.0, predictor.max_age_s) - idle
    gathered = predictor.p_reuse_cdf(table[rows], idle[:, None], horizon[:, None])[:, 0]
    assert predictor.p_reuse_rows(table, rows, idle, horizon).tolist() == gathered.tolist()
    assert len(table) > 2  # sessions with their own gaps have rows of their own


def test_p_reuse_on_shared_grids_of_times_is_p_reuse_cdf_on_each_sessions_own():
    # schedules that start on one age bin's edge share their times: locating them once per
    # grid and reading each session's distribution there gives the same bits as pricing
    # every session's own copy, at edges, inside bins, in bin 0 and past the cut-off
    predictor, table, rows, rng = _learned_distributions(11)
    edges = predictor.edges
    starts = np.concatenate([[0.0, 0.5], edges[[1, 7, 40, 64]], [5000.0]])
    grid = starts[:, None] + 5.0 * 2.0 ** np.arange(-1, 11)[None, :]
    horizon = np.maximum(np.minimum(grid * 1.5, 3600.0) - grid, 0.0)
    at = rng.integers(0, len(starts), len(rows))
    want = predictor.p_reuse_cdf(table[rows], grid[at], horizon[at])
    got = predictor.p_reuse_grid(table, rows, at, grid, horizon)
    assert got.tobytes() == want.tobytes()
    assert want.max() > 0.0 and (want == 0.0).any()  # both live and empty intervals


def test_cdf_with_log_widths_taken_once_per_bin_is_the_per_element_formula():
    """`_cdf_many` divides by each bin's log width taken once per bin: the same bits as the
    formula taken per element, over ages in every bin, past the cut-off and at 0."""
    predictor = ReusePredictor()
    rng = np.random.default_rng(4)
    for _ in range(200):
        predictor.record_gap(("chat", "a", None, None), float(rng.exponential(120.0)), "s")
    cdf = predictor._distribution(("chat", "a", None, None))[0]
    edges = predictor.edges
    x = np.concatenate([[0.0, 0.5, 1.0, edges[-1], 2 * edges[-1]], rng.uniform(0, 4000, 5000)])
    clipped = np.clip(x, 0.0, edges[-1])
    i = np.clip(np.searchsorted(edges, clipped, side="right") - 1, 0, len(edges) - 2)
    lo, hi = edges[i], edges[i + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_share = np.log(np.maximum(clipped, 1e-300) / np.maximum(lo, 1e-300)) / np.log(
            hi / np.maximum(lo, 1e-300)
        )
    share = np.where(i == 0, clipped / hi, log_share)
    want = np.where(x >= edges[-1], cdf[-1], cdf[i] + (cdf[i + 1] - cdf[i]) * share)
    assert predictor._cdf_many(cdf, x).tobytes() == want.tobytes()
    table = np.stack([cdf, cdf * 0.5])
    rows = np.arange(len(x)) % 2
    got = predictor._cdf_many(table, x, rows)
    assert got[rows == 0].tobytes() == want[rows == 0].tobytes()


def _cross_section(seed: int) -> tuple[ReusePredictor, list[SessionView]]:
    """2,000 sessions, each idle for a uniform 0-600 s when we look: 40% never return, the
    rest return after an exponential 30 s gap. Gaps shorter than the idle time have finished
    (recorded); the rest are still running (the sessions idle now)."""
    predictor = ReusePredictor()
    rng = np.random.default_rng(seed)
    idle = []
    for i in range(2000):
        age = float(rng.uniform(0.0, 600.0))
        gap = math.inf if rng.random() < 0.4 else float(rng.exponential(30.0))
        if gap < age:
            predictor.record_gap(KEY, gap)
        else:
            idle.append(SessionView(f"s{i}", "tenant", "chat", idle_since=1000.0 - age))
    return predictor, idle


def _running(idle: list[SessionView], now: float) -> dict:
    running = RunningGaps()
    running.update(Changes(tuple(idle), ()))
    return running.ages(now)


def test_gaps_still_running_count_as_censored():
    # P(return within 30 s | idle 10 s) = 0.6 e^(-1/3) (1 - e^(-1)) / (0.4 + 0.6 e^(-1/3))
    survive = 0.6 * math.exp(-10 / 30)
    truth = survive * (1 - math.exp(-1)) / (0.4 + survive)
    predictor, idle = _cross_section(4)
    # finished gaps alone are the returns only: the sessions that never come back are missing
    assert predictor.p_reuse(KEY, 10.0, 30.0) > truth + 0.2
    predictor.censor(_running(idle, 1000.0))
    assert predictor.p_reuse(KEY, 10.0, 30.0) == pytest.approx(truth, abs=0.04)
    assert predictor.p_reuse(KEY, 0.0, 590.0) == pytest.approx(0.6, abs=0.04)
    # long idle: almost surely one who will not return
    assert predictor.p_reuse(KEY, 300.0, 300.0) < 0.02


def test_ages_no_running_gap_has_reached_fall_back_on_the_prior():
    predictor, idle = _cross_section(5)
    predictor.censor(_running(idle, 1000.0))
    # nobody has been idle 1,000 s yet: the prior's pseudo-sessions set the hazard there, not
    # "nobody returns" (which an estimate from the data alone would say)
    prior_only = ReusePredictor()
    assert predictor.p_reuse(KEY, 1000.0, 600.0) == pytest.approx(
        prior_only.p_reuse(KEY, 1000.0, 600.0), rel=0.05
    )
    # and censoring nothing changes nothing
    plain, _ = _cross_section(5)
    before = plain.p_reuse(KEY, 10.0, 30.0)
    plain.censor(_running([], 1000.0))
    assert plain.p_reuse(KEY, 10.0, 30.0) == before


def test_running_gaps_follow_the_views_changes():
    running = RunningGaps()
    a = SessionView("a", "t", "chat", idle_since=10.0)
    b = SessionView("b", "t", "api", idle_since=40.0)
    running.update(Changes((a, b), ()))
    ages = running.ages(100.0)
    assert ages[("t", "chat", None, None)].tolist() == [90.0] and ages[
        ("t", "api", None, None)
    ].tolist() == [60.0]
    # a returns (active again) and b leaves the view: nothing of either is still running
    running.update(Changes((dataclasses.replace(a, active=True, idle_since=None),), ("b",)))
    assert running.ages(100.0) == {}
    # a idle again, from a later turn: only its new gap runs
    running.update(Changes((dataclasses.replace(a, idle_since=95.0),), ()))
    assert running.ages(100.0)[("t", "chat", None, None)].tolist() == [5.0]


def test_running_gaps_keep_each_keys_idle_sessions_through_many_changes():
    # sessions come, go idle, return and leave in random order; the arrays (grown, with
    # sessions taking each other's slots) must always hold exactly the idle ones' ages
    rng = random.Random(7)
    running = RunningGaps()
    idle_since: dict[str, tuple[Key, float]] = {}
    keys = [("t", "chat"), ("t", "api"), ("u", "chat")]
    for step in range(300):
        news: dict[str, SessionView | None] = {}  # None: leaves the view
        for _ in range(rng.randint(1, 12)):
            sid = f"s{rng.randrange(80)}"
            key, roll = keys[int(sid[1:]) % 3], rng.random()
            if roll < 0.15:
                news[sid] = None
            elif roll < 0.6:
                news[sid] = SessionView(sid, *key, idle_since=float(step - rng.randint(0, 50)))
            else:
                news[sid] = SessionView(sid, *key, active=True)
        changed = tuple(s for s in news.values() if s is not None)
        left = tuple(sid for sid, s in news.items() if s is None)
        running.update(Changes(changed, left))
        for sid in left:
            idle_since.pop(sid, None)
        for s in changed:
            if s.idle:
                idle_since[s.session_id] = (s.reuse_key, float(s.idle_since))
            else:
                idle_since.pop(s.session_id, None)
        want: dict[Key, list[float]] = {}
        for key, since in idle_since.values():
            want.setdefault(key, []).append(max(step + 10.0 - since, 0.0))
        got = running.ages(step + 10.0)
        assert {k: sorted(v.tolist()) for k, v in got.items()} == {
            k: sorted(v) for k, v in want.items()
        }
