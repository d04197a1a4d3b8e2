"""The cost policy's persistent per-session table: its bookkeeping as sessions come, change
and leave, and that the values it keeps are the ones pricing afresh gives."""

from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np
import pytest

from kvtier.policy.actions import Keep
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.session_table import SessionTable, chunk_columns
from kvtier.policy.view import TIER_RANK, PolicyView, QueueView, TurnView, ViewDelta
from kvtier.policy.view_diff import ViewDiff

GB = 10**9
CAPACITY = {"device": 80 * GB, "host": 200 * GB, "disk": 1000 * GB}


def _expected(v, now):
    return sorted(v.candidates(now), key=lambda s: s.session_id)


def _check_columns(table, candidates):
    """The pool rows the table hands out are the sessions' chunks, read afresh."""
    wanted = [chunk_columns(s) for s in candidates.sessions]
    assert np.array_equal(table.columns(candidates), np.concatenate(wanted))
    counts = [len(w) for w in wanted]
    assert candidates.row_session.tolist() == np.repeat(np.arange(len(wanted)), counts).tolist()


def test_candidates_follow_sessions_that_come_change_and_leave(kv):
    table, seen = SessionTable(), ViewDiff()
    a, b = kv.session("a", 1024), kv.session("b", 2048)
    busy = kv.session("c", 512, idle_since=None)  # active: not a candidate
    pinned = kv.session("d", 512, pinned=True)
    held = kv.session("e", 512, ttl_s=100.0, idle_since=0.0)
    v = kv.view([b, busy, a, pinned, held], CAPACITY)
    found = table.sync(v, seen.update(v.sessions), 50.0)
    assert [s.session_id for s in found.sessions] == ["a", "b"]  # session-id order
    assert found.idle_s.tolist() == [50.0, 50.0]
    _check_columns(table, found)
    # past its TTL "e" joins; "a" leaves the view; "b" has a chunk moved to the host
    moved = dataclasses.replace(
        b, chunks=(dataclasses.replace(b.chunks[0], tier="host"), *b.chunks[1:])
    )
    v = kv.view([moved, busy, pinned, held], CAPACITY)
    found = table.sync(v, seen.update(v.sessions), 150.0)
    assert [s.session_id for s in found.sessions] == ["b", "e"]
    assert found.sessions[0] is moved
    _check_columns(table, found)
    ranks = table.columns(found)[:, 4]
    assert ranks[0] == TIER_RANK["host"] and (ranks[1:8] == TIER_RANK["device"]).all()
    # "a" comes back (a fresh slot), and "b" loses all its chunks: nothing left to place
    empty = dataclasses.replace(b, chunks=())
    v = kv.view([empty, busy, pinned, held, a], CAPACITY)
    found = table.sync(v, seen.update(v.sessions), 160.0)
    assert [s.session_id for s in found.sessions] == ["a", "e"]
    assert list(found.sessions) == list(_expected(v, 160.0))
    _check_columns(table, found)


def test_view_diff_names_new_changed_and_departed_sessions(kv):
    seen = ViewDiff()
    a, b, c = kv.session("a", 256), kv.session("b", 256), kv.session("c", 256)
    first = seen.update([b, a])
    assert first.changed == (b, a) and first.left == ()
    assert seen.update([b, a]).changed == ()  # the same objects: nothing to look at
    a2 = dataclasses.replace(a, idle_since=5.0)  # equal ids, another view object
    changes = seen.update([c, a2])
    assert changes.changed == (c, a2) and changes.left == ("b",)
    back = seen.update([a2, b])
    assert back.changed == (b,) and back.left == ("c",)  # "b" is new again


def test_view_diff_takes_the_builders_note_only_against_the_view_it_saw_last(kv):
    seen = ViewDiff()
    a, b = kv.session("a", 256), kv.session("b", 256)
    first = PolicyView((a, b), ())
    assert seen.update(first.sessions, first).changed == (a, b)  # nothing before: compared
    a2 = dataclasses.replace(a, idle_since=5.0)
    # a note against the view it saw last is taken as it is (here one that names b, not a2,
    # so that taking it shows)
    noted = PolicyView((a2, b), (), delta=ViewDelta(first.token, (b,), ()))
    assert seen.update(noted.sessions, noted).changed == (b,)
    # a note against any other view is not: the views are compared
    stale = PolicyView((a2,), (), delta=ViewDelta(first.token, (), ()))
    changes = seen.update(stale.sessions, stale)
    assert changes.changed == (a2,) and changes.left == ("b",)
    assert seen.update([a2]).changed == ()  # and without a view, as before


def test_pool_keeps_every_sessions_rows_through_growth_and_compaction(kv):
    # sessions that keep growing take fresh rows, so the pool fills with dead ones and is
    # compacted (and grown) under them; the rows handed out must stay each session's own
    table, seen = SessionTable(), ViewDiff()
    tokens = {f"s{i:02d}": 256 * (1 + i % 3) for i in range(40)}
    for step in range(30):
        for sid in list(tokens)[step % 4 :: 4]:
            tokens[sid] += 256 * (1 + step % 5)
        v = kv.view([kv.session(sid, n) for sid, n in tokens.items()], CAPACITY)
        found = table.sync(v, seen.update(v.sessions), 10.0 + step)
        assert [s.session_id for s in found.sessions] == sorted(tokens)
        _check_columns(table, found)


def _perturb(rng, v, now, next_id, kv):
    """The view after some traffic: a session returns (active), an active one goes idle
    with more tokens, one leaves, one arrives."""
    sessions = list(v.sessions)
    idle = [i for i, s in enumerate(sessions) if s.idle]
    if idle and rng.random() < 0.5:
        i = rng.choice(idle)
        s = sessions[i]
        turn = TurnView(now - 0.1, 100)
        sessions[i] = dataclasses.replace(s, turns=(*s.turns, turn), active=True, idle_since=None)
    active = [i for i, s in enumerate(sessions) if s.active]
    if active and rng.random() < 0.5:
        i = rng.choice(active)
        s = sessions[i]
        grown = kv.session(s.session_id, 256 * rng.randint(1, 40), idle_since=now)
        sessions[i] = dataclasses.replace(grown, turns=(*s.turns, *grown.turns))
    if sessions and rng.random() < 0.2:
        sessions.pop(rng.randrange(len(sessions)))
    if rng.random() < 0.3:
        extra = {}
        if rng.random() < 0.2:
            extra["ttl_s"] = rng.choice([1.0, 30.0])
        if rng.random() < 0.2:
            extra["priority"] = rng.choice([-1, 1, 2])
        sessions.append(
            kv.session(f"n{next_id:03d}", 256 * rng.randint(1, 40), idle_since=now, **extra)
        )
        next_id += 1
    return sessions, next_id


def _apply(kv, v, actions):
    """`kv.apply`, keeping the view object of every session the actions did not change (as
    the simulator and the engine do)."""
    after = kv.apply(v, actions)
    kept = tuple(
        old if old.chunks == new.chunks else new
        for old, new in zip(v.sessions, after.sessions, strict=True)
    )
    return dataclasses.replace(after, sessions=kept)


@pytest.mark.parametrize("unit", [1, 4])
def test_kept_values_equal_a_fresh_pricing_over_random_decisions(kv, unit):
    """Also with pricing units of up to four chunks: the table's rows are then units, and
    every action still names single chunks."""
    rng = random.Random(7)
    # exact reuse only
    policy = CostPolicy(kv.slow_model(), reprice_tolerance=0.0, pricing_chunks=unit)
    sessions = [kv.session(f"s{i:02d}", 256 * rng.randint(1, 40)) for i in range(12)]
    capacity = {"device": 40 * GB, "host": 20 * GB, "disk": 1000 * GB}
    v = kv.view(sessions, capacity)
    now, next_id = 1.0, 0
    for _ in range(80):
        queue = QueueView(3, 3 * 4096) if rng.random() < 0.3 else QueueView()
        v = kv.view(v.sessions, capacity, queue=queue)
        actions = policy.decide(v, now)
        # sessions idle past the cut-off are not priced: they are acted on only to make room
        wanted, past = [], set()
        for s in _expected(v, now):
            if s.idle_s(now) < policy.predictor.max_age_s:
                wanted.append(s)
            else:
                past.add(s.session_id)
        acted = {a.session_id for a in actions}
        assert acted - past == {s.session_id for s in wanted}
        # each chunk of a priced session is named once (or the whole session kept)
        named = collections.Counter((a.session_id, a.chunk_idx) for a in actions)
        for s in wanted:
            if (s.session_id, None) not in named:
                chunks_named = sorted(i for sid, i in named.elements() if sid == s.session_id)
                assert chunks_named == sorted(c.index for c in s.stored_chunks())
        assert all(not isinstance(a, Keep) for a in actions if a.session_id in past)
        # what they hold per tier is known at once; their chunks, oldest idle first, on demand
        cutoff = policy._state.past_cutoff()
        oldest = sorted(
            (s for s in _expected(v, now) if s.session_id in past),
            key=lambda s: (s.idle_since, s.session_id),
        )
        assert cutoff.held(v.tier_names) == {
            t: sum(c.size_bytes for s in oldest for c in s.chunks_in(t)) for t in v.tier_names
        }
        chunks = cutoff.read()
        assert list(chunks.sessions) == list(oldest)
        assert chunks.columns.tolist() == [
            r for s in oldest for r in chunk_columns(s, unit).tolist()
        ]
        for s in wanted:
            kept = policy._state.priced(s.session_id)
            fresh = policy.value(v, s, now)
            as_rows = [[fresh[i].get(t, -np.inf) for t in v.tier_names] for i in sorted(fresh)]
            assert kept is not None and kept.tolist() == as_rows, (now, s.session_id)
        if rng.random() < 0.3:  # the same view and clock again: the same decision
            assert policy.decide(v, now) == actions
        v = _apply(kv, v, actions)
        sessions, next_id = _perturb(rng, v, now, next_id, kv)
        v = kv.view(sessions, capacity)
        # now and then past the cut-off age, where schedules stop moving and values are reused
        now += rng.choice([0.5, 5.0, 20.0, 300.0, 4000.0])


def _store(table, found, q, d, prices, values):
    """Price every candidate of `found` at `values` (and save as much on a return)."""
    rows, pool_values, pool_gain = table.store(found, np.ones(len(q), dtype=bool), q, d, prices)
    pool_values[rows], pool_gain[rows] = values, values


def test_stale_says_what_no_longer_holds(kv):
    table, seen = SessionTable(), ViewDiff()
    s = dataclasses.replace(
        kv.session("a", 512, tier="host"),  # host only: the device's price does not matter
    )
    v = kv.view([s], CAPACITY)
    found = table.sync(v, seen.update(v.sessions), 10.0)
    q, d = np.array([[0.1, 0.2]]), np.array([[5.0, 10.0]])
    prices = np.array([1.0, 2.0, 3.0])
    assert table.stale(found, q, d, prices).tolist() == [True]  # never priced
    values = np.arange(6.0).reshape(2, 3)
    _store(table, found, q, d, prices, values)
    assert table.priced("a").tolist() == values.tolist()
    assert table.stale(found, q, d, prices).tolist() == [False]
    assert table.stale(found, q, d, np.array([9.0, 2.0, 3.0])).tolist() == [False]
    assert table.stale(found, q, d, np.array([1.0, 2.0, 3.5])).tolist() == [True]
    assert table.stale(found, q * 1.001, d, prices).tolist() == [True]
    assert table.stale(found, q, d + 1e-9, prices).tolist() == [True]
    # a new view of the session: nothing it was priced at is trusted
    moved = dataclasses.replace(s, chunks=s.chunks[:1])
    v = kv.view([moved], CAPACITY)
    found = table.sync(v, seen.update(v.sessions), 11.0)
    assert table.priced("a") is None
    assert table.stale(found, q, d, prices).tolist() == [True]


def test_a_tolerance_reuses_values_until_what_they_were_priced_at_moves_past_it(kv):
    table, seen = SessionTable(tolerance=0.05), ViewDiff()
    v = kv.view([kv.session("a", 512, tier="host")], CAPACITY)
    found = table.sync(v, seen.update(v.sessions), 10.0)
    q, d = np.array([[0.1, 0.2]]), np.array([[5.0, 10.0]])
    prices = np.array([1.0, 2.0, 3.0])
    values = np.arange(6.0).reshape(2, 3)
    assert table.stale(found, q, d, prices).tolist() == [True]  # never priced
    _store(table, found, q, d, prices, values)
    assert table.stale(found, q * 1.04, d, prices * 1.04).tolist() == [False]
    assert table.stale(found, q * 1.06, d, prices).tolist() == [True]
    assert table.stale(found, q, d, prices * [1.0, 1.0, 1.06]).tolist() == [True]
    assert table.stale(found, q, d + 1e-9, prices).tolist() == [True]  # lengths: exact
    # tiny probabilities within the absolute floor count as unchanged, beyond it not
    tiny = np.array([[1e-6, 0.2]])
    _store(table, found, tiny, d, prices, values)
    assert table.stale(found, tiny * [50.0, 1.0], d, prices).tolist() == [False]
    assert table.stale(found, tiny + np.array([[2e-4, 0.0]]), d, prices).tolist() == [True]
    # the comparison is with what it was priced at, so small moves add up to a re-pricing
    _store(table, found, q, d, prices, values)
    assert table.stale(found, q * 1.03, d, prices).tolist() == [False]
    assert table.stale(found, q * 1.03 * 1.03, d, prices).tolist() == [True]


def test_pricing_units_are_runs_of_adjacent_chunks_in_one_tier_cut_at_the_unit(kv):
    s = kv.session("a", 256 * 10)
    tiers = ["device"] * 5 + ["host"] * 3 + ["disk"] * 2
    placed = zip(s.chunks, tiers, strict=True)
    s = dataclasses.replace(s, chunks=tuple(dataclasses.replace(c, tier=t) for c, t in placed))
    single = chunk_columns(s)
    units = chunk_columns(s, 2)
    # index, tokens, token_start, bytes, tier rank, chunks in the unit
    spans = [(0, 2), (2, 2), (4, 1), (5, 2), (7, 1), (8, 2)]
    assert units[:, 5].tolist() == [n for _, n in spans]
    for row, (first, n) in zip(units, spans, strict=True):
        part = single[first : first + n]
        assert row[0] == part[0, 0] and row[2] == part[0, 2] and row[4] == part[0, 4]
        assert row[1] == part[:, 1].sum() and row[3] == part[:, 3].sum()
    assert (chunk_columns(s, 1) == single).all() and single[:, 5].tolist() == [1] * 10
    # a unit as large as the session still stops where the tier changes
    assert chunk_columns(s, 64)[:, 5].tolist() == [5, 3, 2]


def test_candidates_keys_are_grouped_as_their_views_say_through_keys_coming_and_going(kv):
    """Each candidate's key, read back from the groups, is its view's `reuse_key`, and the
    groups are in order of first appearance; keys no live session has are compacted away
    without mixing up the ones still in use."""
    rng = random.Random(7)
    table, seen = SessionTable(), ViewDiff()
    sessions: dict[str, object] = {}
    ever: set[tuple[str, str]] = set()
    for step in range(100):
        # 30 new sessions per step, half of a key of their own and half of a shared one;
        # only the last 90 stay
        for i in range(30):
            sid = f"s{step:02d}-{i:02d}"
            app = f"own{step}-{i}" if i % 2 else f"app{rng.randrange(8)}"
            sessions[sid] = kv.session(sid, 512, app_class=app)
            ever.add(sessions[sid].reuse_key)
        for sid in sorted(sessions)[:-90]:
            del sessions[sid]
        v = kv.view(list(sessions.values()), CAPACITY)
        found = table.sync(v, seen.update(v.sessions), 10.0)
        keys = [s.reuse_key for s in found.sessions]
        assert [found.keys.distinct[i] for i in found.keys.at] == keys
        assert found.keys.distinct == list(dict.fromkeys(keys))
    assert len(ever) > 1400 and len(table._keys) < 1024 + 2 * 90 + 30  # it was compacted
