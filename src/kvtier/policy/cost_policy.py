"""Place each idle chunk where its expected saving minus its holding cost is highest.

For chunk c of an idle session, holding it in tier T until the session returns saves

    w * (R(c) - L_T(c))   seconds, at   B(c) * price_T(u_T)   seconds per second held,

with w = 2**priority, R(c) the marginal recompute seconds of c at its position
(`chunk_recompute_s`: late chunks are dearer than leading ones), L_T(c) its load seconds from T
(0 on the device), B(c) its bytes and price_T(u) the congestion price of `cost_model`.
Dropping is worth 0. All terms are seconds of latency. u is the share of T held by KV no policy
may move (active, pinned and TTL-held sessions): pricing idle KV by an occupancy that counts
itself would make a full tier price out everything in it, empty it, and fill it again on the
next tick. How idle KV shares the rest is settled by the auction below.

Whether it returns comes from the predictor, over a time grid that starts now (idle time t0)
and doubles: t0, t0 + h, t0 + 2h, t0 + 4h, ... up to the cut-off age. q_k = P(return in
[t_k, t_k+1) | still idle at t_k), d_k = t_k+1 - t_k. Demotions and drops cannot be undone
(nothing here promotes), so a chunk's value in T is that of holding it there for the next
interval with the option to demote or drop it later, by backward induction:

    V_K(T) = 0
    V_k(T) = max(0, max over T' at or below T of
                 q_k * w * (R - L_T') - B * price_T' * d_k + (1 - q_k) * V_k+1(T'))
    value_T(c) = q_0 * w * (R - L_T) - B * price_T * d_0 + (1 - q_0) * V_1(T)

A one-step rule (compare only the next interval) is optimal when the return hazard falls with
idle time (the "monotone case" of optimal stopping: Chow, Robbins and Siegmund, "Great
Expectations: The Theory of Optimal Stopping", 1971), but demotes a session that reliably
returns after 15 s because it will not return in the next 5; the induction keeps it. Prices
are assumed to stay as they are now.

Then budgets: tiers are filled fastest first, like an auction. In tier T, the chunks whose best
remaining option is T bid their loss if they do not get it, per byte; the highest bids get the
space (capacity minus what no policy may move). The device is auctioned again at every
decision and a chunk demoted later loses nothing more than one demoted now, so there a chunk
bids only the next interval's saving over where it would go (q_0 * w * L_T' per byte; its
whole value against a drop). Free device space bids against it: the waiting queue with
R_wait * h / W_wait seconds per byte (each second its W_wait bytes are held back, R_wait
requests wait one more), or with no queue the arrivals forecast before the next decision
(`demand.DemandForecast`): the k-th free byte is worth P(arrivals > k) times the seconds per
byte of a spill when they come. So idle KV keeps a device with room for free and is demoted on
the timer once arrivals would need the space. Under pressure `bytes_needed` is set aside
first and nothing else bids (the engine asks for what it needs now). Losers try
the next tier; a chunk no tier takes is dropped. A last pass moves any chunk up into space that
is still free if that is worth more. The policy runs again every h seconds and re-decides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.policy.actions import Action, Drop, Keep, Move
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.cost_model import CostModel
from kvtier.policy.demand import DemandForecast
from kvtier.policy.forms import FormChooser
from kvtier.policy.ledger import ChunkKey
from kvtier.policy.metrics import Calibration
from kvtier.policy.predictor import ReusePredictor
from kvtier.policy.tracker import TurnTracker
from kvtier.policy.view import TIER_RANK, PolicyView, SessionView

GIB = 2**30  # transfer size the spill seconds per byte are taken at

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig


@dataclass
class _Table:
    """Every candidate chunk's net value per tier: one row per chunk, one column per tier of
    the view (fastest first); -inf where the tier is faster than the chunk's (no promotions).
    Rows are in (session id, chunk index) order, which is also the tie-break order."""

    sessions: Sequence[SessionView]
    row_session: np.ndarray  # which of `sessions` each row is a chunk of
    index: np.ndarray  # the chunk's index in its session
    rank: np.ndarray  # TIER_RANK of where the chunk is now
    size: np.ndarray  # bytes
    values: np.ndarray  # [chunks, tiers] seconds over the horizon
    tiers: tuple[str, ...]
    # what one decision interval is worth per tier: P(return within it) * saving, [chunks, tiers]
    next_interval: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    @property
    def keys(self) -> list[ChunkKey]:
        ids = [session.session_id for session in self.sessions]
        rows = zip(self.row_session.tolist(), self.index.tolist(), strict=True)
        return [(ids[s], i) for s, i in rows]

    def held(self, tiers: Sequence[str]) -> dict[str, int]:
        """Bytes these chunks hold per tier."""
        by_rank = np.bincount(self.rank.astype(int), weights=self.size, minlength=len(TIER_RANK))
        return {tier: int(by_rank[TIER_RANK[tier]]) for tier in tiers}


def _columns(session: SessionView) -> np.ndarray:
    """index, tokens, token_start, bytes and tier rank of each stored chunk, one row each."""
    return np.array(
        [
            (c.index, c.tokens, c.token_start, c.size_bytes, TIER_RANK[c.tier])
            for c in session.stored_chunks()
        ],
        dtype=float,
    ).reshape(-1, 5)


def _drifted(
    q: np.ndarray, d: np.ndarray, prices: np.ndarray, parts: Sequence[_Priced], ranks: np.ndarray
) -> np.ndarray:
    """Per session (row), True when its values no longer hold: a return probability or an
    interval length differs from what it was priced at (the last interval ends at the cut-off
    age, so it shortens at every decision), or so does the price of a tier its chunks may
    still use (at or below the fastest one they are in). Exact comparisons: a reused value is
    the one a fresh pricing would give, so reuse never changes a decision (a 20% tolerance
    was tried: on a Mooncake slice it saved no measurable time and moved the TTFT p99 by 11%)."""
    old_q = np.stack([part.q for part in parts])
    old_d = np.stack([part.d for part in parts])
    old_prices = np.stack([part.prices for part in parts])
    top = np.array([part.top for part in parts])
    moved = (q != old_q).any(axis=1) | (d != old_d).any(axis=1)
    drift = prices[None, :] != old_prices
    return moved | (drift & (ranks[None, :] >= top[:, None])).any(axis=1)


@dataclass
class _Priced:
    """One session's chunk columns and, once priced, the values they were given, with what
    they were priced at (the tiers, the return schedule and the tier prices)."""

    view: SessionView
    columns: np.ndarray
    values: np.ndarray | None = None
    soon: np.ndarray | None = None  # next interval's saving per tier
    tiers: tuple[str, ...] = ()
    q: np.ndarray | None = None
    d: np.ndarray | None = None
    prices: np.ndarray | None = None

    top: float = field(init=False)  # rank of the fastest tier holding one of its chunks

    def __post_init__(self) -> None:
        self.top = float(self.columns[:, 4].min()) if len(self.columns) else 0.0

    def price(
        self,
        tiers: tuple[str, ...],
        q: np.ndarray,
        d: np.ndarray,
        prices: np.ndarray,
        values: np.ndarray,
        soon: np.ndarray,
    ) -> None:
        self.tiers, self.q, self.d, self.prices = tiers, q, d, prices
        self.values, self.soon = values, soon


@dataclass
class CostPolicy(RetentionPolicy):
    """kvtier's policy: the formula and allocation are in the module docstring and in
    docs/policy.md. `calibration`, when given, records every prediction for scoring."""

    model: CostModel
    predictor: ReusePredictor = field(default_factory=ReusePredictor)
    horizon_s: float = 5.0
    calibration: Calibration | None = None
    demand: DemandForecast = field(default_factory=DemandForecast)
    forms: FormChooser | None = None  # None: a moved chunk keeps its form
    name = "cost"

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, not {self.horizon_s}")
        self._tracker = TurnTracker(self.predictor.max_age_s)
        self._priced: dict[str, _Priced] = {}

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        return cls(
            model=model,
            predictor=config.predictor.build(),
            horizon_s=config.horizon_s,
            demand=DemandForecast(window_s=config.cost.forecast_window_s),
            forms=FormChooser(model, config.form_budget().allowed),
        )

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        events = self._tracker.update(view, now)
        self.predictor.observe(events)
        self.demand.observe(view, now)
        if self.calibration is not None:
            self.calibration.observe(events)
            self.calibration.expire(now)
        sessions = sorted(view.candidates(now), key=lambda s: s.session_id)
        chunks = self._chunks(sessions, remember=True)
        movable = self._movable(view, chunks)
        table = self._table(view, chunks, now, self._fixed_occupancy(view, movable))
        return _actions(table, self._allocate(view, table, movable, now), self.forms)

    def _movable(self, view: PolicyView, chunks: _Table) -> dict[str, int]:
        """Bytes per tier the candidates' chunks may be placed in: capacity minus everything
        else in the tier (negative when over budget even without them)."""
        held = chunks.held(view.tier_names)
        return {t.name: t.capacity_bytes - t.used_bytes + held[t.name] for t in view.tiers}

    def _fixed_occupancy(self, view: PolicyView, movable: Mapping[str, int]) -> dict[str, float]:
        """Share of each tier held by KV that no policy may move right now."""
        return {
            t.name: 1 - movable[t.name] / t.capacity_bytes if t.capacity_bytes > 0 else 1.0
            for t in view.tiers
        }

    def value(
        self, view: PolicyView, session: SessionView, now: float
    ) -> dict[int, dict[str, float]]:
        """Net value per chunk index and tier: the numbers the policy decides on."""
        candidates = sorted(view.candidates(now), key=lambda s: s.session_id)
        occupancy = self._fixed_occupancy(view, self._movable(view, self._chunks(candidates)))
        table = self._table(view, self._chunks([session]), now, occupancy, record=False)
        return {
            index: {t: float(v) for t, v in zip(table.tiers, row, strict=True) if v > -np.inf}
            for (_, index), row in zip(table.keys, table.values, strict=True)
        }

    def _chunks(self, sessions: Sequence[SessionView], remember: bool = False) -> _Table:
        """The sessions' stored chunks as columns (values not filled in). A session's columns
        (and, once priced, its values) are kept while its view object is unchanged (the
        simulator and the engine reuse it), so a decision over thousands of idle sessions does
        not walk every chunk again."""
        cache = self._priced
        parts = []
        for session in sessions:
            found = cache.get(session.session_id)
            if found is None or found.view is not session:
                found = _Priced(session, _columns(session))
            parts.append(found)
        if remember:  # only the sessions of this view: memory stays bounded by the view
            self._priced = {part.view.session_id: part for part in parts}
        counts = [len(part.columns) for part in parts]
        data = np.concatenate([part.columns for part in parts]) if parts else np.zeros((0, 5))
        return _Table(
            sessions,
            np.repeat(np.arange(len(sessions)), counts),
            data[:, 0].astype(int),
            data[:, 4],
            data[:, 3],
            data[:, 1:3],  # tokens, start: replaced by values in `_table`
            (),
        )

    def _table(
        self,
        view: PolicyView,
        chunks: _Table,
        now: float,
        occupancy: Mapping[str, float],
        record: bool = True,
    ) -> _Table:
        """Fill in every chunk's values. With `record` (a decision), a session's values are
        reused from an earlier decision while its view, its return schedule and the prices of
        the tiers it may use are exactly unchanged (then the values are the ones pricing it
        again would give): re-pricing only what moved keeps the policy cheaper next to the
        simulation it runs in."""
        tiers = view.tier_names
        sessions, row_session = chunks.sessions, chunks.row_session
        if not len(chunks.size):
            empty = np.zeros((0, len(tiers)))
            return dataclasses.replace(chunks, values=empty, tiers=tiers, next_interval=empty)
        q, d = self._schedules(sessions, now)  # [sessions, K]
        if record and self.calibration is not None:
            for session, q0 in zip(sessions, q[:, 0], strict=True):
                self.calibration.predict(session.session_id, now, self.horizon_s, float(q0))
        prices = np.array([self.model.hold_cost(1, t, 1.0, occupancy[t]) for t in tiers])
        # in a decision every session has its entry (`_chunks` made them for this view)
        parts = [self._priced[s.session_id] for s in sessions] if record else []
        known = [
            i for i, part in enumerate(parts) if part.values is not None and part.tiers == tiers
        ]
        stale = np.ones(len(sessions), dtype=bool)
        if known:
            at = np.array(known)
            stale[at] = _drifted(
                q[at],
                d[at],
                prices,
                [parts[i] for i in known],
                np.array([TIER_RANK[t] for t in tiers]),
            )
        rows = stale[row_session]
        fresh_values, fresh_soon = self._induction(chunks, rows, q, d, prices, tiers)
        if not parts:
            return dataclasses.replace(
                chunks, values=fresh_values, tiers=tiers, next_interval=fresh_soon
            )
        ends = np.cumsum(np.bincount(row_session[rows], minlength=len(sessions))[stale])
        first = 0
        for i, end in zip(np.flatnonzero(stale).tolist(), ends.tolist(), strict=True):
            block = slice(first, end)
            parts[i].price(tiers, q[i], d[i], prices, fresh_values[block], fresh_soon[block])
            first = end
        values = np.concatenate([part.values for part in parts])
        soon = np.concatenate([part.soon for part in parts])
        return dataclasses.replace(chunks, values=values, tiers=tiers, next_interval=soon)

    def _induction(
        self,
        chunks: _Table,
        rows: np.ndarray,
        q: np.ndarray,
        d: np.ndarray,
        prices: np.ndarray,
        tiers: Sequence[str],
    ) -> tuple[np.ndarray, np.ndarray]:
        """(values, next interval's saving) of the chunks `rows` selects, by the backward
        induction of the module docstring; tier-major arrays, so each stage is a few passes
        over contiguous rows."""
        row_session = chunks.row_session[rows]
        size, rank = chunks.size[rows], chunks.rank[rows]
        tokens, start = chunks.values[rows, 0], chunks.values[rows, 1]
        weight = np.array([2.0**session.priority for session in chunks.sessions])[row_session]
        # tiers x chunks: what a return saves, and what holding costs per second (the cost
        # model's formulas are plain arithmetic, so they take whole columns at once)
        recompute = self.model.chunk_recompute_s(tokens, start)
        tier_rank = np.array([TIER_RANK[t] for t in tiers])
        gain = np.stack([weight * (recompute - self.model.load_s(size, t)) for t in tiers])
        rent = prices[:, None] * size[None, :]
        q, d = q[row_session].T, d[row_session].T  # [K, chunks]
        count = len(tiers)
        later = np.zeros_like(gain)  # V_k+1, with the freedom to move down or drop later
        for k in range(q.shape[0] - 1, 0, -1):  # past a session's grid q = d = 0: no change
            qk, dk = q[k], d[k]
            stage = np.maximum(qk * gain - rent * dk + (1 - qk) * later, 0.0)
            for j in range(count - 2, -1, -1):  # the best of this tier and any below it
                np.maximum(stage[j], stage[j + 1], out=stage[j])
            later = stage
        q0, d0 = q[0], d[0]
        values = q0 * gain - rent * d0 + (1 - q0) * later
        values[tier_rank[:, None] < rank[None, :]] = -np.inf  # no promotions
        return values.T, (q0 * gain).T

    def _schedules(
        self, sessions: Sequence[SessionView], now: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(q, d) per session over the doubling time grid from its idle time to the
        predictor's cut-off: q[s, k] = P(return in interval k | idle until it), d[s, k] its
        length; zero past a session's last interval (a session past the cut-off gets one
        interval of length `horizon_s` with q = 0)."""
        end = self.predictor.max_age_s
        h = self.horizon_s
        idle = np.array([session.idle_s(now) for session in sessions], dtype=float)
        # interval k ends at idle + h * 2**k
        count = max(2, math.ceil(math.log2(max(end / h, 1.0))) + 2)
        ends = idle[:, None] + h * np.concatenate([[1.0], 2.0 ** np.arange(1, count)])[None, :]
        ends = np.minimum(ends, end)
        starts = np.concatenate([idle[:, None], ends[:, :-1]], axis=1)
        d = np.maximum(ends - starts, 0.0)
        q = self.predictor.p_reuse_sessions(sessions, starts, d)
        q[d <= 0] = 0.0
        past = idle >= end  # nothing left of the grid: one empty interval, as before
        d[past, 0] = h
        return q, d

    def _reserve_bids(self, view: PolicyView, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(bytes, seconds per byte) of the bids for free device space. The waiting queue
        bids R_wait * h / W_wait: each second its W_wait bytes are held back, R_wait requests
        wait one more. Arrivals forecast before the next decision bid for slices of space: the
        slice beyond k is worth P(demand > k) times the seconds per byte of spilling to the
        first lower tier when they come (without a lower tier a spill is a drop, which the
        chunk's own value already prices)."""
        sizes: list[float] = []
        bids: list[float] = []
        if view.pressure:
            # the engine asks for what the queue needs now (`bytes_needed`, set aside first):
            # spilling more would only delay the request that waits for this spill
            return np.array(sizes), np.array(bids)
        if view.waiting_bytes:
            # with a queue, the next interval's admissions are the requests already waiting:
            # arrivals join the queue behind them, so the forecast would count them twice
            sizes.append(float(view.waiting_bytes))
            bids.append(view.queue.waiting_requests * self.horizon_s / view.waiting_bytes)
            return np.array(sizes), np.array(bids)
        lower = [t for t in view.tier_names if t != "device"]
        levels, tail = self.demand.exceedance(self.horizon_s, now)
        if lower and len(levels) > 1:
            per_byte = self.model.load_s(GIB, lower[0]) / GIB
            sizes += np.diff(levels).tolist()
            bids += (tail[:-1] * per_byte).tolist()
        return np.array(sizes), np.array(bids)

    def _allocate(
        self, view: PolicyView, table: _Table, movable: Mapping[str, int], now: float
    ) -> np.ndarray:
        """The column of the tier each chunk gets (-1: dropped)."""
        available = dict(movable)
        if "device" in available and view.pressure:
            available["device"] -= view.bytes_needed
        reserve = self._reserve_bids(view, now)

        values, size, tiers = table.values, table.size, table.tiers
        n, count = values.shape
        placed = np.full(n, -1)  # column of the tier each chunk gets; -1: dropped
        pending = np.ones(n, dtype=bool)
        for j, tier in enumerate(tiers):
            rest = values[:, j:]
            best = j + np.argmax(rest, axis=1)  # ties: the faster tier (the first)
            wants = pending & (best == j) & (values[:, j] > 0)
            rows = np.flatnonzero(wants)
            below = np.maximum(values[rows, j + 1 :].max(axis=1), 0.0) if j + 1 < count else 0.0
            loss = (values[rows, j] - below) / np.maximum(size[rows], 1)  # per byte
            if tier == "device" and j + 1 < count:
                # device space is auctioned again at every decision and a chunk demoted later
                # loses nothing more than one demoted now: what keeping it on the device buys
                # is the next interval's saving over the tier it would go to (a drop cannot
                # be taken back, so against a drop the whole value is at stake)
                lower = j + 1 + np.argmax(values[rows, j + 1 :], axis=1)
                step = table.next_interval[rows, j] - table.next_interval[rows, lower]
                loss = np.where(below > 0, step / np.maximum(size[rows], 1), loss)
            rank = np.lexsort((rows, -loss))  # highest loss first, then key order
            order, bids = rows[rank], loss[rank]
            sizes = size[order]
            partial = np.zeros(len(order), dtype=bool)
            if tier == "device" and len(reserve[0]):
                # free space bids too (-1), first among equals, and takes what is left of a
                # slice that does not fit whole
                bids = np.concatenate([reserve[1], bids])
                ids = np.concatenate([np.full(len(reserve[0]), -1), order])
                sizes = np.concatenate([reserve[0], sizes])
                first = np.lexsort((ids >= 0, -bids))
                order, sizes, partial = ids[first], sizes[first], ids[first] < 0
            taken, available[tier] = _first_fit(sizes, partial, available[tier])
            chosen = order[taken & (order >= 0)]
            placed[chosen] = j
            pending[chosen] = False

        # the sweep never offers a loser a faster tier it preferred less; give it any room left
        current = np.where(placed >= 0, values[np.arange(n), np.maximum(placed, 0)], 0.0)
        better = values > current[:, None]
        hopeful = np.flatnonzero(better.any(axis=1))
        # the most room a tier can have during this pass: what is left now plus everything
        # that might move up out of it; a chunk too large for all its better tiers even then
        # is skipped without changing the outcome
        movers = hopeful[placed[hopeful] >= 0]
        leaving = np.bincount(placed[movers], size[movers], count)
        most = np.array([available[t] for t in tiers]) + leaving
        fits = (better[hopeful] & (size[hopeful, None] <= most[None, :])).any(axis=1)
        for r in hopeful[fits]:
            for j in sorted(range(count), key=lambda c: (-values[r, c], c)):
                if values[r, j] <= current[r]:
                    break
                if size[r] <= available[tiers[j]]:
                    available[tiers[j]] -= size[r]
                    if placed[r] >= 0:
                        available[tiers[placed[r]]] += size[r]
                    placed[r] = j
                    break
        return placed


def _first_fit(sizes: np.ndarray, partial: np.ndarray, room: float) -> tuple[np.ndarray, float]:
    """Walk the bidders in order, each taking its size if it fits in what is left; a
    `partial` bidder that does not fit takes all that is left. Returns (who got their size,
    room left). Whole runs that fit are taken at once: after a bidder that does not fit, only
    those no larger than the room left can still get in, so each pass shortens the list."""
    taken = np.zeros(len(sizes), dtype=bool)
    alive = np.arange(len(sizes))
    while len(alive) and room > 0:
        total = np.cumsum(sizes[alive])
        fit = int(np.searchsorted(total, room, side="right"))
        taken[alive[:fit]] = True
        room -= float(total[fit - 1]) if fit else 0.0
        if fit == len(alive):
            break
        if partial[alive[fit]]:
            return taken, min(room, 0.0)
        alive = alive[fit + 1 :]
        alive = alive[(sizes[alive] <= room) | partial[alive]]
    return taken, room


def _actions(table: _Table, placed: np.ndarray, forms: FormChooser | None) -> list[Action]:
    """`ledger.placement_actions` for the whole table at once: drops first, then moves out of
    the slowest tiers first, then keeps (one per session left where it is). `forms` picks
    each move's form (None: the chunk's own). Only the chunks of sessions with a change are
    visited one by one (a few per decision)."""
    sessions = table.sessions
    if not len(placed):
        return [Keep(session.session_id) for session in sessions]
    column_of_rank = np.full(len(TIER_RANK), -2)
    for j, tier in enumerate(table.tiers):
        column_of_rank[TIER_RANK[tier]] = j
    current = column_of_rank[table.rank.astype(int)]
    changed = np.bincount(table.row_session, weights=placed != current, minlength=len(sessions))
    starts = np.searchsorted(table.row_session, np.arange(len(sessions) + 1))
    drops: list[Action] = []
    moves: list[tuple[int, Action]] = []
    kept: dict[int, list[Action]] = {}  # per changed session, its chunks left in place
    for s in np.flatnonzero(changed).tolist():
        sid, first = sessions[s].session_id, int(starts[s])
        block = slice(first, int(starts[s + 1]))
        index, target = table.index[block].tolist(), placed[block].tolist()
        here, rank = current[block].tolist(), table.rank[block].tolist()
        stored = sessions[s].stored_chunks()
        kept[s] = []
        for r, (i, to, at) in enumerate(zip(index, target, here, strict=True)):
            if to < 0:
                drops.append(Drop(sid, i))
            elif to == at:
                kept[s].append(Keep(sid, i))
            else:
                chunk, tier = stored[r], table.tiers[to]
                form = chunk.form if forms is None else forms.choose(chunk, tier)
                moves.append((-int(rank[r]), Move(sid, i, tier, form)))
    moves.sort(key=lambda item: item[0])  # stable: ties keep session/chunk order
    keeps: list[Action] = []
    for s, session in enumerate(sessions):
        found = kept.get(s)
        if found is None:
            keeps.append(Keep(session.session_id))
        else:
            keeps += found
    return drops + [move for _, move in moves] + keeps
