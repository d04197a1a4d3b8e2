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
and doubles: t0, t0 + h, t0 + 2h, t0 + 4h, ... up to the cut-off age. For the induction t0 is
the idle time rounded down to the predictor's bin edge (`ReusePredictor.age_floor`, 14% steps
by default), so a session's schedule moves in steps and its values are reused until it crosses
an edge or a probability or price moves by more than `reprice_tolerance`; the next interval's
chance that the device auction bids with is taken at the exact idle time at every decision.
q_k = P(return in [t_k, t_k+1) | still idle at t_k), d_k = t_k+1 - t_k. Demotions and drops
cannot be undone (nothing here promotes), so a chunk's value in T is that of holding it there
for the next interval with the option to demote or drop it later, by backward induction:

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
first and the forecast arrivals bid for more, as on the timer: freeing only the need would
call the policy again at the next arrival. The waiting request starts once its need is out
where each chunk frees its space as its copy lands (the simulator, vLLM's offloading worker);
kvtier's engine gathers every moved chunk into host memory on its own thread first, so there
it also waits for those memory copies. The bids set how much
space idle KV keeps; which chunks keep it is ranked over the time a kept byte will stay before
arrivals need it (kept bytes over the forecast's byte rate, by Little's law), by
P(return within that time) * w * L_T' per byte: a session due back in 40 s outranks one due in
ten minutes though neither is likely back in the next interval. Losers try the next tier; a
chunk no tier takes is dropped. A last pass moves any chunk up into space that is still free
if that is worth more. The policy runs again every h seconds and re-decides.

Sessions idle past the predictor's cut-off age are not priced: their KV keeps what each tier
has left after the above and is evicted first when space is needed, oldest idle first
(`past_cutoff.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from kvtier.policy import past_cutoff
from kvtier.policy.actions import Action, Drop, Keep, Move
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.cost_model import CostModel
from kvtier.policy.demand import DemandForecast
from kvtier.policy.forms import FormChooser
from kvtier.policy.kernels import induction, upgrade
from kvtier.policy.metrics import Calibration
from kvtier.policy.predictor import ReusePredictor
from kvtier.policy.running_gaps import RunningGaps
from kvtier.policy.session_table import (
    COLUMNS,
    Candidates,
    SessionTable,
    chunk_columns,
    chunk_positions,
    ranges,
)
from kvtier.policy.tracker import TurnTracker
from kvtier.policy.view import TIER_RANK, PolicyView, SessionView
from kvtier.policy.view_diff import ViewDiff

GIB = 2**30  # transfer size the spill seconds per byte are taken at
_FORM = attrgetter("form")
_SESSION_ID = attrgetter("session_id")

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig


@dataclass
class _Table:
    """Every candidate chunk's net value per tier: one row per chunk, one column per tier of
    the view (fastest first); -inf where the tier is faster than the chunk's (no promotions).
    Rows are in (session id, chunk index) order, which is also the tie-break order."""

    sessions: Sequence[SessionView]
    row_session: np.ndarray  # which of `sessions` each row is a chunk of
    index: np.ndarray  # the chunk's index in its session (a unit's: its first chunk's)
    rank: np.ndarray  # TIER_RANK of where the chunk is now
    size: np.ndarray  # bytes
    values: np.ndarray  # [chunks, tiers] seconds over the horizon
    tiers: tuple[str, ...]
    weight: np.ndarray  # 2 ** priority of each of `sessions`
    span: np.ndarray  # chunks in each row: a pricing unit's run of adjacent chunks
    # each of `sessions`' chance of returning within the next interval, at its exact idle age
    chance: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # what a return saves per tier: rows `pool_rows` (one per chunk) of `saves_pool`
    saves_pool: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    pool_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # each of `sessions`' idle time at the decision (its exact return schedule is priced from
    # it where the device's keepers are ranked)
    idle: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # the predictor's distributions (rows) and each of `sessions`' row in them
    distributions: tuple[np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.zeros((0, 0)), np.zeros(0, dtype=np.int64))
    )

    def next_interval(self, rows: np.ndarray, columns: np.ndarray | int) -> np.ndarray:
        """What the next decision interval is worth to chunks `rows` held in tier `columns`
        (one per row, or one for all): P(return within it) * what a return saves. Only the
        device auction's bidders ask, so it is priced for them alone."""
        saves = self.saves_pool[self.pool_rows[rows], columns]
        return self.chance[self.row_session[rows]] * saves

    def held(self, tiers: Sequence[str]) -> dict[str, int]:
        """Bytes these chunks hold per tier."""
        by_rank = np.bincount(self.rank.astype(int), weights=self.size, minlength=len(TIER_RANK))
        return {tier: int(by_rank[TIER_RANK[tier]]) for tier in tiers}


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
    # a session's values are reused until a return probability or tier price they were
    # priced at moves by more than this share (`SessionTable.stale`); 0: exact reuse only
    reprice_tolerance: float = 0.05
    # adjacent chunks of a session in one tier priced and placed as one unit, up to this many
    # (`session_table.chunk_columns_many`): fewer rows to price, coarser placements
    pricing_chunks: int = 8
    name = "cost"

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, not {self.horizon_s}")
        self._tracker = TurnTracker(self.predictor.max_age_s)
        self._state = SessionTable(
            self.reprice_tolerance, self.predictor.max_age_s, self.pricing_chunks
        )
        self._changes = ViewDiff()
        self._running = RunningGaps()
        # the doubling grid from every bin edge of the predictor (the ages stepped schedules
        # start at) and where its times fall in the bins: the same at every decision, so found
        # once (row e is edge e's), like the table and tracker above from the same predictor
        starts, d = self._grid(self.predictor.edges)
        self._edge_grids = (starts, d, self.predictor.locate_grid(starts, d))

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        return cls(
            model=model,
            predictor=config.predictor.build(),
            horizon_s=config.horizon_s,
            demand=DemandForecast(window_s=config.cost.forecast_window_s),
            forms=FormChooser(model, config.form_budget().allowed),
            pricing_chunks=config.cost.pricing_chunks,
        )

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        changes = self._changes.update(view.sessions, view)  # the view's changes, once for all
        events = self._tracker.update(view, now, changes)
        self.predictor.observe(events)
        self._running.update(changes)
        self.predictor.censor(self._running.ages(now))  # the gaps still running
        self.demand.observe(view, now, changes)
        if self.calibration is not None:
            self.calibration.observe(events)
            self.calibration.expire(now)
        candidates = self._state.sync(view, changes, now)
        columns = self._state.columns(candidates)
        chunks = _chunk_table(
            candidates.sessions, candidates.row_session, columns, candidates.weight
        )
        past = self._state.past_cutoff()
        held = self._state.held(candidates, view.tier_names)
        movable = self._movable(view, held, past.held(view.tier_names))
        table = self._priced_table(view, candidates, chunks, now, movable)
        placed, room = self._allocate(view, table, movable, now)
        # what the priced chunks leave is for the sessions past the cut-off, newest idle first
        evicted = past_cutoff.evict(
            past, room, table.tiers, self.model, self.forms, view.device_shortage()
        )
        return _actions(
            table, placed, self.forms, candidates.keeps, candidates.chunk_keeps, evicted
        )

    def _movable(
        self, view: PolicyView, held: Mapping[str, int], past: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Bytes per tier the candidates' chunks (`held`, bytes per tier) may be placed in:
        capacity minus everything else in the tier (negative when over budget even without
        them) but the chunks of sessions past the cut-off (`past`, bytes per tier), which make
        way for them."""
        extra = past or {}
        return {
            t.name: t.capacity_bytes - t.used_bytes + held[t.name] + extra.get(t.name, 0)
            for t in view.tiers
        }

    def _fixed_occupancy(self, view: PolicyView, movable: Mapping[str, int]) -> dict[str, float]:
        """Share of each tier held by KV that no policy may move right now."""
        return {
            t.name: 1 - movable[t.name] / t.capacity_bytes if t.capacity_bytes > 0 else 1.0
            for t in view.tiers
        }

    def value(
        self, view: PolicyView, session: SessionView, now: float
    ) -> dict[int, dict[str, float]]:
        """Net value per chunk index and tier: the numbers the policy decides on, priced from
        scratch (nothing kept from a decision is used)."""
        candidates = sorted(view.candidates(now), key=lambda s: s.session_id)
        held = _fresh_chunks(candidates).held(view.tier_names)
        occupancy = self._fixed_occupancy(view, self._movable(view, held))
        chunks = _fresh_chunks([session], self.pricing_chunks)
        if not len(chunks.size):
            return {}
        tiers = view.tier_names
        q, d = self._schedules([session], np.array([session.idle_s(now)]))
        prices = self._prices(tiers, occupancy)
        n = len(chunks.size)
        values, gain = np.empty((n, len(tiers))), np.empty((n, len(tiers)))
        self._induction(chunks, q, d, prices, tiers, np.arange(n), values, gain)
        return {
            index: {t: float(v) for t, v in zip(tiers, row, strict=True) if v > -np.inf}
            for index, row in zip(chunks.index.tolist(), values, strict=True)
        }

    def _prices(self, tiers: Sequence[str], occupancy: Mapping[str, float]) -> np.ndarray:
        """Each tier's holding cost per byte-second at its occupancy."""
        return np.array([self.model.hold_cost(1, t, 1.0, occupancy[t]) for t in tiers])

    def _priced_table(
        self,
        view: PolicyView,
        candidates: Candidates,
        chunks: _Table,
        now: float,
        movable: Mapping[str, int],
    ) -> _Table:
        """Fill in every chunk's values. A session's values are reused from an earlier
        decision while its view is the same, its return schedule (conditioned on its idle
        age's bin edge, so it moves in steps) has the same interval lengths and return
        probabilities within `reprice_tolerance`, and so are the prices of the tiers it may
        use (`SessionTable.stale`): re-pricing only what moved keeps the policy cheaper next
        to the simulation it runs in. The next interval's saving, which the device auction
        ranks by, is priced afresh at every decision at the exact idle age."""
        tiers = view.tier_names
        if not len(chunks.size):
            empty = np.zeros((0, len(tiers)))
            return dataclasses.replace(chunks, values=empty, tiers=tiers, saves_pool=empty)
        cdf = self.predictor.cdf_table(chunks.sessions, candidates.keys, candidates.ids)
        q, d = self._schedule_rows(*cdf, candidates.idle_s)  # [sessions, K]
        q_now = self._next_interval(*cdf, candidates.idle_s)
        if self.calibration is not None:
            self.calibration.predict_many(candidates.ids, now, self.horizon_s, q_now)
        prices = self._prices(tiers, self._fixed_occupancy(view, movable))
        state = self._state
        stale = state.stale(candidates, q, d, prices)
        # the stale sessions' chunks, read in place (None: all of them)
        priced = None if stale.all() else np.flatnonzero(stale[chunks.row_session])
        # the induction writes the stale sessions' values into the table, which hands back
        # every candidate's (a reused session's as it was priced)
        rows, pool_values, pool_gain = state.store(candidates, stale, q, d, prices)
        self._induction(chunks, q, d, prices, tiers, rows, pool_values, pool_gain, priced)
        # the next interval is priced at the exact idle age every decision: the device auction
        # ranks by it, and it is what moves fastest (the long view of `values` moves in steps)
        return dataclasses.replace(
            chunks,
            values=state.values(candidates),
            tiers=tiers,
            chance=q_now,
            saves_pool=pool_gain,
            pool_rows=candidates.rows,
            idle=candidates.idle_s,
            distributions=cdf,
        )

    def _induction(
        self,
        chunks: _Table,
        q: np.ndarray,
        d: np.ndarray,
        prices: np.ndarray,
        tiers: Sequence[str],
        at: np.ndarray,
        values: np.ndarray,
        gain: np.ndarray,
        priced: np.ndarray | None = None,
    ) -> None:
        """Write rows `at` of `values` and `gain` ([rows, tiers]): the values and what a
        return saves of each chunk of `chunks` (whose `values` still hold tokens and start;
        only the chunks `priced`, when given: `at` has a row for each of those), its
        sessions' schedules `q`, `d`, by the backward induction of the module docstring, in
        the compiled kernel of `induction` (one session's chunks at a time, its schedule read
        in place)."""
        row_session, size, rank = chunks.row_session, chunks.size, chunks.rank
        tokens, start = chunks.values[:, 0], chunks.values[:, 1]
        if priced is not None:
            row_session, size, rank = row_session[priced], size[priced], rank[priced]
            tokens, start = tokens[priced], start[priced]
        weight = chunks.weight[row_session]
        # tiers x chunks: what a return saves (the cost model's formulas are plain
        # arithmetic, so they take whole columns at once)
        recompute = self.model.chunk_recompute_s(tokens, start)
        saves = np.stack([weight * (recompute - self.model.load_s(size, t)) for t in tiers])
        induction(
            saves,
            np.ascontiguousarray(size, dtype=float),
            np.ascontiguousarray(prices, dtype=float),
            np.ascontiguousarray(q, dtype=float),
            np.ascontiguousarray(d, dtype=float),
            np.ascontiguousarray(row_session, dtype=np.int64),
            rank.astype(np.int64),
            np.array([TIER_RANK[t] for t in tiers], dtype=np.int64),
            np.ascontiguousarray(at, dtype=np.int64),
            values,
            gain,
        )

    def _schedules(
        self, sessions: Sequence[SessionView], idle: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """`_schedule_rows` of the sessions' distributions (`ReusePredictor.cdf_table`)."""
        if not len(sessions):
            return np.zeros((0, 2)), np.zeros((0, 2))
        return self._schedule_rows(*self.predictor.cdf_table(sessions), idle)

    def _next_interval(self, table: np.ndarray, rows: np.ndarray, idle: np.ndarray) -> np.ndarray:
        """P(return within `horizon_s` | idle exactly `idle[s]`) per session s (distribution
        `table[rows[s]]`): the next interval's chance."""
        now_for = np.minimum(idle + self.horizon_s, self.predictor.max_age_s) - idle
        q_now = self.predictor.p_reuse_rows(table, rows, idle, now_for)
        q_now[now_for <= 0] = 0.0
        return q_now

    def _schedule_rows(
        self, table: np.ndarray, rows: np.ndarray, idle: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(q, d) per session over the doubling time grid from its idle time to the
        predictor's cut-off, conditioned on the bin edge at or below its idle time `idle`
        (`ReusePredictor.age_floor`): q[s, k] = P(return in interval k | idle until it),
        d[s, k] its length; zero past a session's last interval (a session past the cut-off
        gets one interval of length `horizon_s` with q = 0), compiled per session
        (`ReusePredictor.p_reuse_grid`). Session s has distribution `table[rows[s]]`."""
        end = self.predictor.max_age_s
        edge = self.predictor.age_edge(idle)  # the age bin's edge each schedule starts at
        # one grid of times per age bin, located in the bins once (at construction)
        grid_starts, grid_d, found = self._edge_grids
        q = self.predictor.p_reuse_grid(table, rows, edge, grid_starts, grid_d, found)
        d = grid_d[edge]  # q is 0 on an empty interval
        d[self.predictor.edges[edge] >= end, 0] = self.horizon_s  # past the cut-off
        return q, d

    def _grid(self, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each interval's start, its length) per row, on the doubling grid from `start` to
        the cut-off: interval k ends at start + h * 2**k."""
        end = self.predictor.max_age_s
        h = self.horizon_s
        count = max(2, math.ceil(math.log2(max(end / h, 1.0))) + 2)
        ends = start[:, None] + h * np.concatenate([[1.0], 2.0 ** np.arange(1, count)])[None, :]
        ends = np.minimum(ends, end)
        starts = np.concatenate([start[:, None], ends[:, :-1]], axis=1)
        return starts, np.maximum(ends - starts, 0.0)

    def _reserve_bids(self, view: PolicyView, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(bytes, seconds per byte) of the bids for free device space. The waiting queue
        bids R_wait * h / W_wait: each second its W_wait bytes are held back, R_wait requests
        wait one more. Arrivals forecast before the next decision bid for slices of space: the
        slice beyond k is worth P(demand > k) times the seconds per byte of spilling to the
        first lower tier when they come (without a lower tier a spill is a drop, which the
        chunk's own value already prices). Under pressure the engine's ask (`bytes_needed`,
        set aside first) is for the request it cannot admit, and the forecast bids for what
        comes after it: freeing only the ask would call the policy again at the next
        admission."""
        sizes: list[float] = []
        bids: list[float] = []
        if view.waiting_bytes and not view.pressure:
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

    def _keepers(
        self,
        table: _Table,
        rows: np.ndarray,
        lower: np.ndarray,
        below: np.ndarray,
        loss: np.ndarray,
        kept: float,
        now: float,
    ) -> np.ndarray:
        """Which of the device's bidders `rows` (each to go to column `lower` if demoted, or
        dropped where `below` <= 0, losing `loss` per byte then) get the `kept` bytes the
        auction leaves idle KV. A chunk kept now stays until arrivals need its space: on a
        device that stays full, idle KV makes way at the rate arrivals bring bytes, so by
        Little's law a kept byte stays about `kept / rate` (the characteristic time of an LRU
        cache, Che et al., IEEE JSAC 2002). Each chunk is ranked by what it saves per byte if
        its session returns within that time, `P(return within it) * w * L_lower / B`, rather
        than within one interval: a session due back in 40 s is worth keeping over one due in
        10 minutes even though neither is likely back in the next 5 s."""
        rate = self.demand.byte_rate(self.horizon_s, now)
        end = self.predictor.max_age_s
        stay = min(max(kept / rate, self.horizon_s), end) if rate > 0 else end
        # over the schedule from the exact idle time (not the stepped one the induction
        # prices): sessions in one age bin would tie, and age orders them
        of_rows = table.row_session[rows]  # ascending, as `rows` are: runs of one session
        sessions = of_rows[np.flatnonzero(np.diff(of_rows, prepend=-1))]
        cdf, which = table.distributions
        back = np.zeros(len(table.sessions))
        back[sessions] = self._back_within(cdf, which[sessions], table.idle[sessions], stay)
        back = back[of_rows]
        size = np.maximum(table.size[rows], 1)
        saving = np.zeros(len(rows))
        for j in np.unique(lower).tolist():
            at = lower == j
            saving[at] = self.model.load_s(size[at], table.tiers[j])
        worth = table.weight[table.row_session[rows]] * back * saving / size
        worth = np.where(below > 0, worth, loss)  # a drop cannot be taken back: whole value
        order = rows[np.argsort(-worth, kind="stable")]  # rows ascend: ties in key order
        taken, _ = _first_fit(table.size[order], np.zeros(len(order), dtype=bool), kept)
        return order[taken]

    def _back_within(
        self, table: np.ndarray, rows: np.ndarray, idle: np.ndarray, span: float
    ) -> np.ndarray:
        """`_return_within(span)` of the schedules from the exact idle times `idle` (the grid
        of `_schedule_rows`, not stepped): the intervals that start `span` or more from now add
        a factor of exactly 1 to the product, so their chances are not computed (left at 0).
        The intervals before are priced as in the whole schedule: the same answer to the last
        bit."""
        end = self.predictor.max_age_s
        starts, d = self._grid(idle)
        # grid columns with an interval that starts before `span`, from now as
        # `_return_within` finds it (the same sums, so the same columns)
        offset = np.cumsum(d, axis=1) - d
        before = ((offset < span) & (d > 0)).any(axis=0)
        m = int(np.count_nonzero(before))
        q = np.zeros_like(d)
        # contiguous copies: numpy's vector loops take the logarithms, as on the whole grid
        q[:, :m] = self.predictor.p_reuse_grid(
            table,
            rows,
            np.arange(len(rows)),
            np.ascontiguousarray(starts[:, :m]),
            np.ascontiguousarray(d[:, :m]),
        )  # 0 on an empty interval
        d[idle >= end, 0] = self.horizon_s  # as `_schedule_rows`: one empty interval
        return _return_within(q, d, span)

    def _allocate(
        self, view: PolicyView, table: _Table, movable: Mapping[str, int], now: float
    ) -> tuple[np.ndarray, dict[str, float]]:
        """The column of the tier each chunk gets (-1: dropped), and the bytes each tier has
        left after them."""
        available = dict(movable)
        if "device" in available and view.pressure:
            available["device"] -= view.bytes_needed
        reserve = self._reserve_bids(view, now)

        values, size, tiers = table.values, table.size, table.tiers
        n, count = values.shape
        columns = np.ascontiguousarray(values.T)  # one contiguous row per tier
        # per tier j, the best column at or below it (ties: the faster tier, the first) and
        # its value, from the slowest tier up
        best_from = [np.full(n, count - 1)] * count
        top_from = [columns[count - 1]] * count
        for j in range(count - 2, -1, -1):
            here = columns[j] >= top_from[j + 1]
            best_from[j] = np.where(here, j, best_from[j + 1])
            top_from[j] = np.where(here, columns[j], top_from[j + 1])
        placed = np.full(n, -1, dtype=np.int64)  # column of the tier each chunk gets; -1: dropped
        pending = np.ones(n, dtype=bool)
        for j, tier in enumerate(tiers):
            wants = pending & (best_from[j] == j) & (columns[j] > 0)
            rows = np.flatnonzero(wants)
            room, demand = available[tier], float(size[rows].sum())  # exact: whole bytes
            reserved = float(reserve[0].sum()) if tier == "device" else 0.0
            if room > 0 and demand + reserved <= room:
                # every bidder fits, free space's too: the order they are served in does not
                # matter
                placed[rows], pending[rows] = j, False
                available[tier] = room - demand - reserved
                continue
            below = np.maximum(top_from[j + 1][rows], 0.0) if j + 1 < count else 0.0
            loss = (columns[j][rows] - below) / np.maximum(size[rows], 1)  # per byte
            if tier == "device" and j + 1 < count:
                # device space is auctioned again at every decision and a chunk demoted later
                # loses nothing more than one demoted now: what keeping it on the device buys
                # is the next interval's saving over the tier it would go to (a drop cannot
                # be taken back, so against a drop the whole value is at stake)
                lower = best_from[j + 1][rows]
                step = table.next_interval(rows, j) - table.next_interval(rows, lower)
                loss = np.where(below > 0, step / np.maximum(size[rows], 1), loss)
            rank = np.argsort(-loss, kind="stable")  # highest loss first, then key order
            order, bids = rows[rank], loss[rank]
            sizes = size[order]
            partial = np.zeros(len(order), dtype=bool)
            if tier == "device" and len(reserve[0]):
                # free space bids too (-1), first among equals, and takes what is left of a
                # slice that does not fit whole
                bids = np.concatenate([reserve[1], bids])
                ids = np.concatenate([np.full(len(reserve[0]), -1), order])
                sizes = np.concatenate([reserve[0], sizes])
                first = np.argsort(-bids, kind="stable")  # reserve first: it comes first
                order, sizes, partial = ids[first], sizes[first], ids[first] < 0
            taken, available[tier] = _first_fit(sizes, partial, available[tier])
            chosen = order[taken & (order >= 0)]
            if tier == "device" and j + 1 < count and len(chosen) < len(rows):
                # the auction sets how much space idle KV keeps; who keeps it is ranked over
                # the time that space will stay theirs
                kept = float(size[chosen].sum())
                chosen = self._keepers(table, rows, lower, below, loss, kept, now)
                available[tier] += kept - float(size[chosen].sum())
            placed[chosen] = j
            pending[chosen] = False

        # the sweep never offers a loser a faster tier it preferred less; give it any room left
        # (compiled: a walk over the chunks in order, each taking the room the ones before it
        # left)
        room = np.array([float(available[t]) for t in tiers])
        upgrade(np.ascontiguousarray(values), np.ascontiguousarray(size, dtype=float), room, placed)
        return placed, dict(zip(tiers, room.tolist(), strict=True))


def _chunk_table(
    sessions: Sequence[SessionView],
    row_session: np.ndarray,
    columns: np.ndarray,
    weight: np.ndarray,
) -> _Table:
    """The sessions' chunks (`session_table.COLUMNS`, one row each) as a table whose values
    are not filled in yet."""
    return _Table(
        sessions,
        row_session,
        columns[:, 0].astype(int),
        columns[:, 4],
        columns[:, 3],
        columns[:, 1:3],  # tokens, start: replaced by values when priced
        (),
        weight,
        columns[:, 5].astype(np.int64),
    )


def _fresh_chunks(sessions: Sequence[SessionView], unit: int = 1) -> _Table:
    """`_chunk_table` of sessions read from their views, without the persistent table."""
    parts = [chunk_columns(session, unit) for session in sessions]
    counts = [len(part) for part in parts]
    columns = np.concatenate(parts) if parts else np.zeros((0, COLUMNS))
    weight = np.array([2.0**session.priority for session in sessions], dtype=float)
    return _chunk_table(sessions, np.repeat(np.arange(len(sessions)), counts), columns, weight)


def _chunks_of(rows: np.ndarray, span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each chunk's row, its place in the row's unit) for the chunks of units `rows`, in
    row order."""
    count = span[rows]
    return np.repeat(rows, count), ranges(np.zeros_like(count), count)


def _return_within(q: np.ndarray, d: np.ndarray, span: float) -> np.ndarray:
    """P(return within `span` s from now) per session, from schedules (q, d) as `_schedules`
    gives them; the hazard is taken as constant inside each interval."""
    if not q.size:
        return np.zeros(len(q))
    offset = np.cumsum(d, axis=1) - d  # each interval's start, from now
    inside = np.clip(span - offset, 0.0, d)
    share = np.divide(inside, d, out=np.zeros_like(d), where=d > 0)
    stay = np.power(np.clip(1.0 - q, 0.0, 1.0), share)
    return 1.0 - stay.prod(axis=1)


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


def _actions(
    table: _Table,
    placed: np.ndarray,
    forms: FormChooser | None,
    keeps: Sequence[Keep],
    chunk_keeps: Sequence[dict[int, Keep]],
    evicted: tuple[list[Action], list[tuple[int, Action]]] = ([], []),
) -> list[Action]:
    """`ledger.placement_actions` for the whole table at once: drops first, then moves out of
    the slowest tiers first, then keeps (one per session left where it is: `keeps`, each
    session's `Keep`; in a session with a change, one per chunk left in place, taken from and
    added to its `chunk_keeps`, so actions that recur are made once). `forms` picks each
    move's form (None: the chunk's own). `evicted` (drops, and moves keyed by minus their
    source tier's rank) are those of the sessions past the cut-off (`past_cutoff.evict`),
    ordered in with these. Which rows drop, move or stay is found in array passes; only the
    drops and moves are built one by one (a few per decision), and the chunk keeps of
    sessions with a change are looked up in their memo by a C-level map."""
    sessions = table.sessions
    column_of_rank = np.full(len(TIER_RANK), -2)
    for j, tier in enumerate(table.tiers):
        column_of_rank[TIER_RANK[tier]] = j
    current = column_of_rank[table.rank.astype(int)]
    moving = placed != current
    drops, moves = list(evicted[0]), list(evicted[1])
    if not moving.any():
        moves.sort(key=lambda item: item[0])
        return drops + [move for _, move in moves] + list(keeps)
    row_session, index, span = table.row_session, table.index, table.span
    starts = np.searchsorted(row_session, np.arange(len(sessions) + 1))
    # a row is a unit of `span` chunks with consecutive indices: its actions are its chunks'
    # (`_chunks_of`: each chunk's row and its place in the unit)
    drop_rows, drop_offset = _chunks_of(np.flatnonzero(placed < 0), span)
    drops += [
        Drop(sessions[s].session_id, i)
        for s, i in zip(
            row_session[drop_rows].tolist(), (index[drop_rows] + drop_offset).tolist(), strict=True
        )
    ]
    move_rows = np.flatnonzero(moving & (placed >= 0))
    # out of the slowest tiers first; stable, so ties keep session/chunk order
    move_rows = move_rows[np.argsort(-table.rank[move_rows], kind="stable")]
    move_rows, move_offset = _chunks_of(move_rows, span)
    move_sessions = row_session[move_rows]
    # each moving chunk's place among its session's stored chunks
    at_in_session = chunk_positions(span, np.diff(starts))[move_rows] + move_offset
    chunks = list(
        map(
            tuple.__getitem__,
            map(SessionView.stored_chunks, map(sessions.__getitem__, move_sessions.tolist())),
            at_in_session.tolist(),
        )
    )
    targets = list(map(table.tiers.__getitem__, placed[move_rows].tolist()))
    chosen = list(map(_FORM, chunks)) if forms is None else forms.choose_many(chunks, targets)
    ours = list(
        map(
            Move,
            map(_SESSION_ID, map(sessions.__getitem__, move_sessions.tolist())),
            (index[move_rows] + move_offset).tolist(),
            targets,
            chosen,
        )
    )
    if moves:  # the evicted sessions' moves, ordered in by their source tiers
        moves += zip((-table.rank[move_rows]).astype(int).tolist(), ours, strict=True)
        moves.sort(key=lambda item: item[0])  # stable: ties keep session/chunk order
        ours = [move for _, move in moves]
    changed = np.bincount(row_session, weights=moving, minlength=len(sessions)) > 0
    stay, stay_offset = _chunks_of(
        np.flatnonzero(~moving & np.repeat(changed, np.diff(starts))), span
    )
    # the staying chunks of all sessions with a change, in row order, cut per session below
    stay_index = (index[stay] + stay_offset).tolist()
    stay_ends = np.cumsum(np.bincount(row_session[stay], minlength=len(sessions))).tolist()
    left: list[Action] = []
    done = 0  # sessions before this one are in `left`
    for s in np.flatnonzero(changed).tolist():
        left += keeps[done:s]  # unchanged sessions: their whole-session Keep
        staying = stay_index[stay_ends[s - 1] if s else 0 : stay_ends[s]]
        memo = chunk_keeps[s]
        for i in set(staying).difference(memo):
            memo[i] = Keep(sessions[s].session_id, i)
        left += map(memo.__getitem__, staying)
        done = s + 1
    left += keeps[done:]
    return drops + ours + left
