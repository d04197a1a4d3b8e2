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
space (capacity minus what no policy may move). On the device the waiting queue bids too, with
R_wait * h / W_wait seconds per byte (each second its W_wait bytes are held back, R_wait
requests wait one more second); under pressure `bytes_needed` is set aside first. Losers try
the next tier; a chunk no tier takes is dropped. A last pass moves any chunk up into space that
is still free if that is worth more. The policy runs again every h seconds and re-decides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.policy.actions import Action
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.cost_model import CostModel
from kvtier.policy.ledger import ChunkKey, placement_actions, room
from kvtier.policy.metrics import Calibration
from kvtier.policy.predictor import ReusePredictor
from kvtier.policy.tracker import TurnTracker
from kvtier.policy.view import TIER_RANK, PolicyView, SessionView

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig


@dataclass
class _Bid:
    key: ChunkKey
    size: int
    values: dict[str, float]  # tier -> net value over the horizon, seconds

    def best(self, from_rank: int) -> str | None:
        """Best tier at or below `from_rank`, None (drop) unless some tier is worth > 0;
        equal values go to the faster tier, which is the one the chunk is in already."""
        options = [
            (v, -TIER_RANK[t], t) for t, v in self.values.items() if TIER_RANK[t] >= from_rank
        ]
        value, _, tier = max(options, default=(0.0, 0, None))
        return tier if value > 0 else None

    def loss_per_byte(self, tier: str) -> float:
        """What losing `tier` costs, per byte: its value minus the next best option's."""
        below = [v for t, v in self.values.items() if TIER_RANK[t] > TIER_RANK[tier]]
        return (self.values[tier] - max([0.0, *below])) / max(self.size, 1)


@dataclass
class CostPolicy(RetentionPolicy):
    """kvtier's policy: the formula and allocation are in the module docstring and in
    docs/policy.md. `calibration`, when given, records every prediction for scoring."""

    model: CostModel
    predictor: ReusePredictor = field(default_factory=ReusePredictor)
    horizon_s: float = 5.0
    calibration: Calibration | None = None
    name = "cost"

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, not {self.horizon_s}")
        self._tracker = TurnTracker(self.predictor.max_age_s)

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        return cls(model=model, predictor=config.predictor.build(), horizon_s=config.horizon_s)

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        events = self._tracker.update(view, now)
        self.predictor.observe(events)
        if self.calibration is not None:
            self.calibration.observe(events)
            self.calibration.expire(now)
        sessions = sorted(view.candidates(now), key=lambda s: s.session_id)
        occupancy = self._fixed_occupancy(view, sessions)
        bids = [bid for s in sessions for bid in self._bids(view, s, now, occupancy)]
        return placement_actions(sessions, self._allocate(view, sessions, bids))

    def _fixed_occupancy(
        self, view: PolicyView, candidates: Sequence[SessionView]
    ) -> dict[str, float]:
        """Share of each tier held by KV that no policy may move right now."""
        movable = room(view, candidates)
        return {
            t.name: 1 - movable[t.name] / t.capacity_bytes if t.capacity_bytes > 0 else 1.0
            for t in view.tiers
        }

    def value(
        self, view: PolicyView, session: SessionView, now: float
    ) -> dict[int, dict[str, float]]:
        """Net value per chunk index and tier: the numbers the policy decides on."""
        occupancy = self._fixed_occupancy(view, view.candidates(now))
        bids = self._bids(view, session, now, occupancy, record=False)
        return {bid.key[1]: bid.values for bid in bids}

    def _bids(
        self,
        view: PolicyView,
        session: SessionView,
        now: float,
        occupancy: Mapping[str, float],
        record: bool = True,
    ) -> list[_Bid]:
        chunks = session.stored_chunks()
        schedule = self._schedule(session, session.idle_s(now))
        if record and self.calibration is not None:
            self.calibration.predict(session.session_id, now, self.horizon_s, schedule[0][0])
        weight = 2.0**session.priority
        # chunks x tiers: what a return saves, and what holding costs per second (the cost
        # model's formulas are plain arithmetic, so they take whole columns at once)
        tokens = np.array([c.tokens for c in chunks], dtype=float)
        start = np.array([c.token_start for c in chunks], dtype=float)
        size = np.array([c.size_bytes for c in chunks], dtype=float)
        recompute = self.model.chunk_recompute_s(tokens, start)
        gain = np.column_stack(
            [weight * (recompute - self.model.load_s(size, t.name)) for t in view.tiers]
        )
        rent = np.column_stack(
            [self.model.hold_cost(size, t.name, 1.0, occupancy[t.name]) for t in view.tiers]
        )
        later = np.zeros_like(gain)  # V_k+1, with the freedom to move down or drop later
        for q, d in reversed(schedule[1:]):
            stage = np.maximum(q * gain - rent * d + (1 - q) * later, 0.0)
            later = np.maximum.accumulate(stage[:, ::-1], axis=1)[:, ::-1]
        q, d = schedule[0]
        value = q * gain - rent * d + (1 - q) * later
        bids = []
        for row, chunk in zip(value, chunks, strict=True):
            values = {
                tier.name: float(v)
                for tier, v in zip(view.tiers, row, strict=True)
                if TIER_RANK[tier.name] >= TIER_RANK[chunk.tier]  # no promotions
            }
            bids.append(_Bid((session.session_id, chunk.index), chunk.size_bytes, values))
        return bids

    def _schedule(self, session: SessionView, idle_s: float) -> list[tuple[float, float]]:
        """(q_k, d_k) over the doubling time grid from `idle_s` to the predictor's cut-off."""
        end = self.predictor.max_age_s
        schedule = []
        start, step = idle_s, self.horizon_s
        while start < end:
            stop = min(idle_s + step, end)
            schedule.append((self.predictor.p_reuse(session, start, stop - start), stop - start))
            start, step = stop, 2 * step
        return schedule or [(0.0, self.horizon_s)]

    def _allocate(
        self, view: PolicyView, sessions: list[SessionView], bids: list[_Bid]
    ) -> dict[ChunkKey, str | None]:
        available = room(view, sessions)
        if "device" in available and view.pressure:
            available["device"] -= view.bytes_needed
        queue_bytes = view.waiting_bytes
        queue_bid = view.queue.waiting_requests * self.horizon_s / queue_bytes if queue_bytes else 0

        target: dict[ChunkKey, str | None] = {}
        pending = bids
        for tier in view.tier_names:
            rank = TIER_RANK[tier]
            entries = [
                (bid.loss_per_byte(tier), bid.key, bid) for bid in pending if bid.best(rank) == tier
            ]
            if tier == "device" and queue_bytes:
                entries.append((queue_bid, ("", -1), None))  # the queue wins ties
            entries.sort(key=lambda entry: (-entry[0], entry[1]))
            for _, key, bid in entries:
                if bid is None:
                    available[tier] -= min(max(available[tier], 0), queue_bytes)
                elif bid.size <= available[tier]:
                    available[tier] -= bid.size
                    target[key] = tier
            pending = [bid for bid in pending if bid.key not in target]
        for bid in pending:
            target[bid.key] = None

        # the sweep never offers a loser a faster tier it preferred less; give it any room left
        for bid in bids:
            current = target[bid.key]
            current_value = bid.values[current] if current is not None else 0.0
            for tier, value in sorted(
                bid.values.items(), key=lambda tv: (-tv[1], TIER_RANK[tv[0]])
            ):
                if value <= current_value:
                    break
                if bid.size <= available[tier]:
                    available[tier] -= bid.size
                    if current is not None:
                        available[current] += bid.size
                    target[bid.key] = tier
                    break
        return target
