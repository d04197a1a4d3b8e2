"""The compiled backward induction gives bit for bit the values of the straightforward numpy
passes over a real decision's inputs (the table, schedules and prices the policy builds)."""

from __future__ import annotations

import collections
import dataclasses
import math
import random

import numpy as np
import pytest

from kvtier.policy.cost_model import Prices
from kvtier.policy.cost_policy import CostPolicy, _chunk_table
from kvtier.policy.kernels import MAX_TIERS, induction, pairwise_sum, upgrade
from kvtier.policy.predictor import SESSION_WEIGHTS
from kvtier.policy.view import TIER_RANK
from kvtier.policy.view_diff import ViewDiff

GB = 10**9


def _reference(policy, chunks, q, d, prices, tiers):
    """The induction as plain numpy passes over [tiers, chunks], each session's schedule
    repeated out to its chunks."""
    tokens, start = chunks.values[:, 0], chunks.values[:, 1]
    weight = chunks.weight[chunks.row_session]
    recompute = policy.model.chunk_recompute_s(tokens, start)
    gain = np.stack([weight * (recompute - policy.model.load_s(chunks.size, t)) for t in tiers])
    tier_rank = np.array([TIER_RANK[t] for t in tiers])
    values = _numpy_induction(
        gain, chunks.size, prices, q, d, chunks.row_session, chunks.rank, tier_rank
    )
    return values.T, gain.T


def _numpy_induction(gain, size, prices, q, d, row_session, rank, tier_rank):
    """The backward induction as numpy passes over [tiers, chunks] (the kernel's arguments,
    each session's schedule repeated out to its chunks): values [tiers, chunks]."""
    rent = prices[:, None] * size[None, :]
    q, d = q[row_session].T, d[row_session].T
    later = np.zeros_like(gain)
    for k in range(q.shape[0] - 1, 0, -1):
        stage = np.maximum(q[k] * gain - rent * d[k] + (1 - q[k]) * later, 0.0)
        for j in range(len(gain) - 2, -1, -1):
            stage[j] = np.maximum(stage[j], stage[j + 1])
        later = stage
    values = q[0] * gain - rent * d[0] + (1 - q[0]) * later
    values[tier_rank[:, None] < rank[None, :]] = -np.inf
    return values


def _decision_inputs(kv, policy, rng, now, occupied):
    """A view of sessions in every tier at idle ages from a second to past the cut-off, and
    the chunks, schedules and prices the policy prices them with."""
    sessions = []
    for i in range(40):
        tier = rng.choice(["device", "device", "host", "disk"])
        idle_since = now - rng.choice([0.5, 3.0, 40.0, 700.0, 5000.0]) * rng.random()
        extra = {"priority": rng.choice([-1, 0, 0, 1])}
        tokens = 256 * rng.randint(1, 30) + rng.randint(0, 255)
        sessions.append(kv.session(f"s{i:02d}", tokens, tier=tier, idle_since=idle_since, **extra))
    capacity = {"device": 40 * GB, "host": 60 * GB, "disk": 1000 * GB}
    v = kv.view(sessions, capacity, other_used={"device": int(occupied * 40 * GB)})
    found = policy._state.sync(v, ViewDiff().update(v.sessions), now)
    columns = policy._state.columns(found)
    chunks = _chunk_table(found.sessions, found.row_session, columns, found.weight)
    q, d = policy._schedules(found.sessions, found.idle_s)
    movable = policy._movable(v, chunks.held(v.tier_names))
    prices = policy._prices(v.tier_names, policy._fixed_occupancy(v, movable))
    return chunks, q, d, prices, v.tier_names


def test_compiled_induction_equals_numpy_passes_bit_for_bit(kv):
    rng = random.Random(3)
    for trial in range(12):
        # a floor price on space, so holding costs rent at every stage
        floor = [0.0, 1e-5, 1e-3][trial % 3]
        prices = Prices.from_dollars(floor_dollars_per_gb_hour=floor)
        # chunk by chunk: many rows, so every path of the kernel is met
        policy = CostPolicy(dataclasses.replace(kv.slow_model(), prices=prices), pricing_chunks=1)
        # returns the predictor learnt from: the schedules differ per class and age
        for _ in range(trial * 20):
            policy.predictor.record_gap(kv.session("k", 256).reuse_key, rng.expovariate(1 / 30.0))
        now = 6000.0 + trial
        inputs = _decision_inputs(kv, policy, rng, now, occupied=rng.choice([0.0, 0.5, 0.97]))
        chunks, q, d, prices, tiers = inputs
        assert len(chunks.size) > 100 and (q > 0).any() and (d == 0).any()
        # written into scattered rows of a larger table, as the policy's session table has
        n = len(chunks.size)
        at = np.array(rng.sample(range(2 * n), n))
        pool_values, pool_gain = np.zeros((2 * n, len(tiers))), np.zeros((2 * n, len(tiers)))
        policy._induction(chunks, q, d, prices, tiers, at, pool_values, pool_gain)
        values, gain = pool_values[at], pool_gain[at]
        want_values, want_gain = _reference(policy, chunks, q, d, prices, tiers)
        assert np.array_equal(gain, want_gain)
        # the same bits: equal values, -inf where a tier is faster than the chunk's
        assert values.tobytes() == np.ascontiguousarray(want_values).tobytes()
        assert np.isinf(values).any() and (values > 0).any()


def test_a_chunk_keeps_the_option_of_a_tier_two_below_its_own():
    """The continuation of holding a chunk in a tier is the best of that tier and every tier
    below it, not only the next one down: here the next interval in the device or on host
    is worth less than nothing (their rent) and on disk something, so the device's value
    carries the disk's option. Worked by hand for two stages."""
    gain = np.array([[1.0], [0.9], [0.8]])  # device, host, disk: what a return saves
    size, prices = np.array([1.0]), np.array([2.0, 3.0, 0.1])  # rent per second
    q, d = np.array([[0.5, 0.5]]), np.array([[0.1, 1.0]])
    values, saves = np.empty((1, 3)), np.empty((1, 3))
    zero = np.zeros(1, dtype=np.int64)
    induction(gain, size, prices, q, d, zero, zero, np.arange(3), zero, values, saves)
    stage = [max(0.0, 0.5 * g - p * 1.0) for g, p in ((1.0, 2.0), (0.9, 3.0), (0.8, 0.1))]
    assert stage == [0.0, 0.0, 0.30000000000000004]  # only the disk's next stage is worth it
    want = [0.5 * g - p * 0.1 + 0.5 * stage[2] for g, p in ((1.0, 2.0), (0.9, 3.0), (0.8, 0.1))]
    assert values[0].tolist() == want
    assert saves[0].tolist() == gain[:, 0].tolist()


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_compiled_induction_equals_numpy_passes_on_random_inputs(count):
    """Any tier count the views have (device alone up to remote), scattered output rows,
    schedules that end early (d = 0), values of both signs, a NaN gain: the same bits as the
    numpy passes, whichever tier below a chunk's is its best continuation."""
    assert len(TIER_RANK) == MAX_TIERS  # the kernel holds this many tiers in registers
    rng = np.random.default_rng(count)
    sessions, stages, per = 40, 9, 7
    n = sessions * per
    gain = rng.normal(size=(count, n)) * rng.choice([1e-6, 1.0, 1e3], size=(count, n))
    gain[0, 5] = np.nan
    size = rng.random(n) * 1e7
    prices = rng.random(count) * 1e-8
    q = rng.random((sessions, stages)) * 0.3
    d = rng.choice([0.0, 5.0, 40.0, 600.0], size=(sessions, stages))
    row_session = np.repeat(np.arange(sessions), per)
    rank = rng.integers(0, count, n)
    tier_rank = np.arange(count)
    at = rng.permutation(2 * n)[:n]
    values, saves = np.zeros((2 * n, count)), np.zeros((2 * n, count))
    induction(gain, size, prices, q, d, row_session, rank, tier_rank, at, values, saves)
    want = _numpy_induction(gain, size, prices, q, d, row_session, rank, tier_rank)
    assert values[at].tobytes() == np.ascontiguousarray(want.T).tobytes()
    assert saves[at].tobytes() == np.ascontiguousarray(gain.T).tobytes()


def _upgrade_reference(values, size, room, placed):
    """The allocation's last pass as a Python loop: rows in order, each tries its tiers best
    first (ties: the first) while worth more than where it is, and takes the first with
    room."""
    room, placed = list(room), placed.copy()
    for r, row in enumerate(values.tolist()):
        at = int(placed[r])
        now = row[at] if at >= 0 else 0.0
        better = [j for j in sorted(range(len(row)), key=lambda j: -row[j]) if row[j] > now]
        to = next((j for j in better if size[r] <= room[j]), None)  # sorted() is stable
        if to is not None:
            room[to] -= size[r]
            if at >= 0:
                room[at] += size[r]
            placed[r] = to
    return room, placed


def test_compiled_last_pass_equals_the_python_walk(kv):
    rng = random.Random(5)
    moved = 0
    for trial in range(12):
        policy = CostPolicy(kv.slow_model())
        now = 6000.0 + trial
        chunks, q, d, prices, tiers = _decision_inputs(kv, policy, rng, now, occupied=0.5)
        n = len(chunks.size)
        values, gain = np.empty((n, len(tiers))), np.empty((n, len(tiers)))
        policy._induction(chunks, q, d, prices, tiers, np.arange(n), values, gain)
        # where an auction might have left them: any tier at or below theirs, or dropped
        lowest = [TIER_RANK[t] for t in tiers]
        placed = np.array(
            [
                rng.choice([-1, *(j for j, r in enumerate(lowest) if r >= rank)])
                for rank in chunks.rank
            ],
            dtype=np.int64,
        )
        room = np.array([rng.choice([0.0, 1e8, 3e9, 4e10]) for _ in tiers])
        before = placed.copy()
        want_room, want_placed = _upgrade_reference(values, chunks.size, room, placed)
        upgrade(values, np.ascontiguousarray(chunks.size), room, placed)
        assert placed.tolist() == want_placed.tolist() and room.tolist() == want_room
        moved += int((want_placed != before).sum())
    assert moved > 100  # the walk did move chunks up


def test_compiled_distribution_equals_the_numpy_blend(kv):
    """The predictor's distributions after real returns are bit for bit the numpy blend of
    each histogram with its prior and `cumsum`."""
    rng = random.Random(11)
    predictor = CostPolicy(kv.slow_model()).predictor
    keys = [kv.session("k", 256, app_class=c).reuse_key for c in ("chat", "code", "agent")]
    for step in range(600):
        key = keys[step % 3]
        gap = rng.expovariate(1 / rng.choice([3.0, 60.0, 900.0]))
        predictor.record_gap(key, gap, session_id=f"s{rng.randrange(40)}")
        if step % 37 == 0:
            predictor.record_no_return(key)
        if step % 50 == 0:
            weight = predictor.prior.weight
            pooled = predictor._pooled
            want = np.cumsum(
                (pooled.counts + weight * predictor._prior_masses) / (pooled.total + weight)
            )
            got = predictor._distribution(None)[0]
            assert got[0] == 0.0 and got[1:].tobytes() == want.tobytes()
            histogram = predictor._keys[key]
            base = np.diff(got)
            want = np.cumsum((histogram.counts + weight * base) / (histogram.total + weight))
            assert predictor._distribution(key)[0][1:].tobytes() == want.tobytes()
            assert want[-1] < 1.0 and (np.diff(want) > 0).any()


def _life_table_reference(counts, no_return, total, censored):
    """The actuarial life table in numpy passes, as the predictor first computed it."""
    seen = total + float(censored.sum())
    left = np.concatenate([[0.0], np.cumsum(counts + censored)[:-1]])
    at_risk = seen - left - censored / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, np.minimum(counts / at_risk, 1.0), 0.0)
    survival = np.concatenate([[1.0], np.cumprod(1.0 - hazard)])
    return survival[:-1] * hazard, float(survival[-1])


def test_compiled_life_table_equals_the_numpy_passes(kv):
    """With gaps still running, the predictor's distributions are bit for bit the numpy life
    table's, for young and old running gaps."""
    rng = np.random.default_rng(5)
    predictor = CostPolicy(kv.slow_model()).predictor
    key = kv.session("k", 256, app_class="chat").reuse_key
    for step in range(300):
        predictor.record_gap(key, float(rng.exponential(rng.choice([3.0, 60.0, 900.0]))), "s")
        if step % 40 == 0:
            predictor.record_no_return(key)
    weight = predictor.prior.weight
    for ages in (rng.uniform(0, 50, 30), rng.uniform(0, 3000, 400)):
        predictor.censor({key: ages})
        pooled_cdf, pooled_none = predictor._distribution(None)
        histogram = predictor._keys[key]
        masses, no_return = _life_table_reference(
            histogram.counts + weight * np.diff(pooled_cdf),
            histogram.no_return + weight * pooled_none,
            histogram.total + weight,
            predictor._censored[key],
        )
        cdf, got_none = predictor._distribution(key)
        assert cdf[0] == 0.0 and cdf[1:].tobytes() == np.cumsum(masses).tobytes()
        assert got_none == no_return and 0.0 < no_return < 1.0


def _numpy_mine(predictor, gaps):
    """A session's own gaps as cumulative counts at the bin edges, in the numpy passes
    `kernels.own_cumulative` replaced after the convolution."""
    counts = np.bincount(np.array(gaps, dtype=int), minlength=len(predictor.edges) - 1)
    full = np.convolve(counts.astype(float), predictor._kernel)
    half = predictor._kernel_half
    spread = full[half:-half]
    spread[0] += full[:half].sum()
    spread[-1] += full[-half:].sum()
    return np.concatenate([[0.0], np.cumsum(spread)])


def _python_score(predictor, key, gaps, gap_s):
    """The scores one outcome adds, as `ReusePredictor._score` computed them in Python before
    `kernels.score_return`: the key's distribution (what it backs off to for a key not seen),
    blended with the session's own gaps at each candidate weight, at the edges the outcome
    touches."""
    cdf = predictor._distribution(key)[0]  # a key not seen yet: what it backs off to
    late = gap_s >= predictor.max_age_s
    at = (-1,) if late else (predictor._bin(gap_s), predictor._bin(gap_s) + 1)
    key_at = [float(cdf[i]) for i in at]
    mine = _numpy_mine(predictor, gaps)
    mine_at = [float(mine[i]) for i in at]
    added = []
    for weight in SESSION_WEIGHTS:
        if weight == math.inf:
            blended = key_at
        else:
            pairs = zip(mine_at, key_at, strict=True)
            blended = [(m + weight * c) / (len(gaps) + weight) for m, c in pairs]
        p = 1.0 - blended[0] if late else blended[1] - blended[0]
        added.append(math.log(max(p, 1e-12)))
    return added


def test_a_return_is_scored_as_the_python_passes_scored_it(kv):
    # one compiled call per return (`kernels.score_return`): bit for bit the scores the
    # Python arithmetic gave, for known keys and one never seen, returns and no-returns,
    # with and without gaps running
    rng = np.random.default_rng(8)
    predictor = CostPolicy(kv.slow_model()).predictor
    keys = [("t", "chat"), ("t", "api")]
    checked = 0
    for step in range(400):
        if step == 200:  # gaps running, also of keys not seen yet (scored as the pooled)
            running = {keys[0]: rng.uniform(0, 3000, 50), keys[1]: rng.uniform(0, 9, 5)}
            running |= {("t", f"new{s}"): rng.uniform(0, 600, 20) for s in range(249, 400, 50)}
            predictor.censor(running)
        key = ("t", f"new{step}") if step % 50 == 49 else keys[step % 2]
        session = f"s{step % 7}"
        gap = float(rng.exponential(60.0)) if step % 9 else 5000.0  # past the cut-off: late
        own = predictor._sessions.get(session)
        histogram = predictor._keys.get(key)
        before = histogram.scores.copy() if histogram is not None else np.zeros(4)
        want = _python_score(predictor, key, list(own), gap) if own else None
        if gap < predictor.max_age_s:
            predictor.record_gap(key, gap, session)
        else:
            predictor.record_no_return(key, session)
        if want is not None:
            got = predictor._keys[key].scores
            assert got.tobytes() == (before + np.array(want)).tobytes(), step
            checked += 1
    assert checked > 300 and predictor._censored


@pytest.mark.parametrize("seed", range(5))
def test_own_gaps_are_folded_and_summed_as_numpy_did(kv, seed):
    rng = np.random.default_rng(seed)
    predictor = CostPolicy(kv.slow_model()).predictor
    bins = len(predictor.edges) - 1
    for _ in range(200):
        gaps = rng.integers(0, bins, rng.integers(1, 9)).tolist()
        # near the ends too, where the kernel's tails are folded back
        gaps += rng.choice([0, 1, bins - 2, bins - 1], rng.integers(0, 3)).tolist()
        predictor._sessions["s"] = collections.deque(gaps)
        predictor._own.clear()
        assert predictor._mine("s").tobytes() == _numpy_mine(predictor, gaps).tobytes()


def test_pairwise_sum_is_numpys_sum():
    rng = np.random.default_rng(3)
    for n in [*range(0, 300), 1000, 4099]:
        a = rng.standard_normal(n + 5) * 10.0 ** rng.integers(-8, 8, n + 5)
        assert pairwise_sum(a, 3, n) == a[3 : 3 + n].sum(), n


def _numpy_units(out, counts, unit):
    """Single-chunk rows merged into pricing units in numpy passes (what
    `kernels.merge_units` replaced)."""
    n = len(out)
    session = np.repeat(np.arange(len(counts)), counts)
    starts = np.ones(n, dtype=bool)
    starts[1:] = (
        (session[1:] != session[:-1])
        | (out[1:, 0] != out[:-1, 0] + 1)
        | (out[1:, 4] != out[:-1, 4])
    )
    run_first = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    at = np.flatnonzero(starts | ((np.arange(n) - run_first) % unit == 0))
    merged = out[at].copy()
    merged[:, 1] = np.add.reduceat(out[:, 1], at)
    merged[:, 3] = np.add.reduceat(out[:, 3], at)
    merged[:, 5] = np.diff(np.append(at, n))
    return merged, np.bincount(session[at], minlength=len(counts))


@pytest.mark.parametrize("seed", range(20))
def test_compiled_unit_merge_equals_the_numpy_passes(seed):
    # sessions of 0-30 chunks with index gaps and tier changes, merged at units of 1-9
    from kvtier.policy.session_table import _units

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 30, 12)
    rows = []
    for count in counts:
        index = np.cumsum(rng.choice([1, 1, 1, 2], count)) - 1
        tier = np.sort(rng.integers(0, 3, count))
        tokens = rng.integers(1, 1024, count)
        for i, t, k in zip(index, tier, tokens, strict=True):
            rows.append([i, k, 1024 * i, k * 4096, t, 1.0])
    out = np.array(rows, dtype=float).reshape(-1, 6)
    unit = int(rng.integers(1, 10))
    got, units = _units(out, counts, unit)
    want, want_units = _numpy_units(out, counts, unit)
    assert got.tobytes() == want.tobytes() and units.tolist() == want_units.tolist()
    assert unit == 1 or len(got) < len(out) or not len(out)


@pytest.mark.parametrize("tolerance", [0.0, 0.05])
def test_compiled_stale_test_equals_the_numpy_passes(tolerance):
    # `SessionTable.stale`'s test on random schedules and prices near what they were priced
    # at: every reason to re-price appears, alone and together
    from kvtier.policy.kernels import stale_rows
    from kvtier.policy.session_table import Q_FLOOR

    rng = np.random.default_rng(3)
    slots_total, n, k, tiers = 50, 40, 8, 3
    was_q = rng.uniform(0, 1, (slots_total, k))
    was_d = rng.choice([5.0, 10.0, 20.0], (slots_total, k))
    was_prices = np.tile(rng.uniform(0.5, 2, tiers), (slots_total, 1))
    top = rng.integers(0, 3, slots_total).astype(float)
    priced = rng.random(slots_total) < 0.9
    slots = rng.permutation(slots_total)[:n]
    # a few rows' probabilities move a little (within 5%) or a lot, a few interval lengths
    # change, and the device's price moves 10% (stale only where a chunk is on the device)
    q, d = was_q[slots].copy(), was_d[slots].copy()
    rows, columns = rng.integers(0, n, 12), rng.integers(0, k, 12)
    q[rows[:6], columns[:6]] *= 1.01
    q[rows[6:9], columns[6:9]] *= 1.2
    d[rows[9:], columns[9:]] = 40.0
    prices = was_prices[0].copy()
    prices[0] *= 1.1
    ranks = np.array([0, 1, 2], dtype=np.int64)
    floor = Q_FLOOR if tolerance else 0.0
    got = np.empty(n, dtype=bool)
    stale_rows(
        q, d, prices, ranks, slots, was_q, was_d, was_prices, top, priced, tolerance, floor, got
    )
    moved = (np.abs(q - was_q[slots]) > tolerance * was_q[slots] + floor).any(axis=1)
    moved |= (d != was_d[slots]).any(axis=1)
    drift = (
        np.abs(prices[None, :] - was_prices[slots]) > tolerance * np.abs(was_prices[slots])
    ) & (ranks[None, :] >= top[slots][:, None])
    want = ~priced[slots] | moved | drift.any(axis=1)
    assert got.tolist() == want.tolist()
    assert 0 < want.sum() < n
