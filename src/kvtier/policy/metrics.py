"""What the policies did and how good their predictions were, in numbers an operator graphs.

- `PolicyMetrics`: decisions per kind and tier, bytes moved between tiers and bytes dropped
  (Prometheus names in `samples()`).
- `Calibration`: each reuse prediction p against whether the session did return within the
  horizon; Brier score and reliability bins (Brier, "Verification of forecasts expressed in
  terms of probability", Monthly Weather Review, 1950).
- `Regret`: realised cost of a policy minus the oracle's on the same replay.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.policy.actions import Action, Drop, Keep, Move
from kvtier.policy.tracker import Returned, SessionEvent
from kvtier.policy.view import TIER_RANK, ChunkView, PolicyView


class PolicyMetrics:
    def __init__(self) -> None:
        self.decisions: Counter[tuple[str, str]] = Counter()  # (keep|demote|promote|drop, tier)
        self.bytes_moved: Counter[tuple[str, str]] = Counter()  # (from tier, to tier)
        self.bytes_dropped: Counter[str] = Counter()  # tier the bytes were dropped from

    def record(self, view: PolicyView, actions: Iterable[Action]) -> None:
        """Count `actions` against the chunks of the `view` they were decided on."""
        sessions = {session.session_id: session for session in view.sessions}
        stored: dict[str, dict[int, ChunkView]] = {}  # per session, built when first needed
        for action in actions:
            if action.chunk_idx is None and isinstance(action, Keep):
                # a whole session left in place (most of them, on most decisions): count it
                # per tier without visiting its chunks
                session = sessions[action.session_id]
                for tier in session.tiers_held():
                    self.decisions["keep", tier] += len(session.chunks_in(tier))
                continue
            chunks = stored.get(action.session_id)
            if chunks is None:
                chunks = stored[action.session_id] = {
                    c.index: c for c in sessions[action.session_id].chunks if c.tier is not None
                }
            if action.chunk_idx is None:
                selected = list(chunks.values())
            else:
                chunk = chunks.get(action.chunk_idx)
                selected = [] if chunk is None else [chunk]
            for chunk in selected:
                source = chunk.tier
                if isinstance(action, Keep):
                    self.decisions["keep", source] += 1
                elif isinstance(action, Drop):
                    self.decisions["drop", source] += 1
                    self.bytes_dropped[source] += chunk.size_bytes
                elif isinstance(action, Move) and action.tier != source:
                    slower = TIER_RANK[action.tier] > TIER_RANK[source]
                    self.decisions["demote" if slower else "promote", source] += 1
                    self.bytes_moved[source, action.tier] += chunk.size_bytes

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(metric name, labels, value) for a Prometheus exporter."""
        out = [
            ("kvtier_policy_decisions_total", {"decision": kind, "tier": tier}, float(n))
            for (kind, tier), n in sorted(self.decisions.items())
        ]
        out += [
            ("kvtier_policy_moved_bytes_total", {"from": src, "to": dst}, float(n))
            for (src, dst), n in sorted(self.bytes_moved.items())
        ]
        out += [
            ("kvtier_policy_dropped_bytes_total", {"tier": tier}, float(n))
            for tier, n in sorted(self.bytes_dropped.items())
        ]
        return out


@dataclass(frozen=True)
class ReliabilityBin:
    low: float
    high: float
    count: int
    mean_predicted: float
    observed_rate: float


@dataclass
class _Batch:
    """One decision's predictions: made together, due together."""

    made_at: float
    deadline: float
    position: dict[str, int]  # session id -> its prediction's place in `ps`
    ps: np.ndarray
    open: np.ndarray  # not resolved yet

    def close(self, at: np.ndarray | slice) -> np.ndarray:
        """The still open predictions among `at`, now closed."""
        ps = self.ps[at][self.open[at]]
        self.open[at] = False
        return ps


@dataclass
class Calibration:
    """Predicted P(return within horizon) against what happened. Predictions wait until the
    session returns or the horizon passes; at most `max_pending` wait (oldest resolved first,
    as not returned), so memory is bounded. A decision's predictions are kept together as
    arrays, and those no return resolved are scored as misses in one array pass when they
    fall due: one Python step per return instead of one per prediction."""

    bins: int = 10
    max_pending: int = 100_000
    _batches: deque[_Batch] = field(default_factory=deque)  # in the order made
    _count: np.ndarray = field(init=False)
    _sum_p: np.ndarray = field(init=False)
    _sum_hit: np.ndarray = field(init=False)
    _squared_error: float = 0.0
    _pending_total: int = 0

    def __post_init__(self) -> None:
        self._count = np.zeros(self.bins, dtype=np.int64)
        self._sum_p = np.zeros(self.bins)
        self._sum_hit = np.zeros(self.bins, dtype=np.int64)

    def score(self, policy: object) -> bool:
        """Record `policy`'s reuse predictions here if it makes any (a `calibration`
        attribute) and nobody scores them yet; whether it does (the simulator and the
        benchmark report the score)."""
        if getattr(policy, "calibration", False) is not None:
            return False
        policy.calibration = self  # type: ignore[attr-defined]
        return True

    def predict(self, session_id: str, made_at: float, horizon_s: float, p: float) -> None:
        self.predict_many((session_id,), made_at, horizon_s, (p,))

    def predict_many(
        self,
        session_ids: Sequence[str],
        made_at: float,
        horizon_s: float,
        ps: Sequence[float] | np.ndarray,
    ) -> None:
        """`predict` for each session, all made at once (one decision's)."""
        if not len(session_ids):
            return
        ps = np.array(ps, dtype=float)  # a copy: the caller's array may change
        if len(ps) != len(session_ids):
            raise ValueError("one prediction per session")
        excess = self._pending_total + len(ps) - self.max_pending
        while excess > 0 and self._batches:  # the oldest made are resolved first, as misses
            oldest = self._batches[0]
            first = np.flatnonzero(oldest.open)[:excess]
            self._resolve(oldest.close(first), False)
            excess -= len(first)
            if not oldest.open.any():
                self._batches.popleft()
        position = dict(zip(session_ids, range(len(ps)), strict=True))
        self._batches.append(
            _Batch(made_at, made_at + horizon_s, position, ps, np.ones(len(ps), dtype=bool))
        )
        self._pending_total += len(ps)
        if excess > 0:  # more than max_pending at once: the first of these go too
            self._resolve(self._batches[-1].close(slice(0, excess)), False)

    def observe(self, events: Iterable[SessionEvent]) -> None:
        outcomes: tuple[list[float], list[float]] = ([], [])  # (missed, returned in time)
        for event in events:
            if not isinstance(event, Returned):
                continue
            for batch in self._batches:  # the few not yet due, oldest first
                if batch.made_at >= event.at:
                    break
                at = batch.position.get(event.session_id)
                if at is not None and batch.open[at]:
                    batch.open[at] = False
                    outcomes[event.at <= batch.deadline].append(float(batch.ps[at]))
        for returned, ps in enumerate(outcomes):
            self._resolve(np.array(ps), bool(returned))

    def expire(self, now: float) -> None:
        """Predictions whose horizon ended before `now` without a return were misses."""
        kept: deque[_Batch] = deque()
        for batch in self._batches:
            if batch.deadline < now:
                self._resolve(batch.close(slice(None)), False)
            else:
                kept.append(batch)
        self._batches = kept

    @property
    def resolved(self) -> int:
        return int(self._count.sum())

    def brier(self) -> float:
        """Mean squared error of the predictions; 0 is perfect, 0.25 is always saying 0.5."""
        return self._squared_error / self.resolved if self.resolved else float("nan")

    def reliability(self) -> list[ReliabilityBin]:
        """Per bin of predicted p: how often sessions really returned (ideal: the diagonal)."""
        out = []
        for i, n in enumerate(self._count.tolist()):
            if n:
                low, high = i / self.bins, (i + 1) / self.bins
                mean, rate = float(self._sum_p[i]) / n, int(self._sum_hit[i]) / n
                out.append(ReliabilityBin(low, high, n, mean, rate))
        return out

    def summary(self) -> dict[str, Any]:
        """What a results file keeps: the Brier score, how many predictions it covers, and the
        reliability bins."""
        return {
            "brier": self.brier() if self.resolved else None,
            "predictions": self.resolved,
            "reliability": [dataclasses.asdict(b) for b in self.reliability()],
        }

    def line(self) -> str:
        """One line for a console: Brier score, then predicted -> observed per bin."""
        bins = ", ".join(
            f"{b.mean_predicted:.2f}->{b.observed_rate:.2f} (n={b.count:,})"
            for b in self.reliability()
        )
        return f"Brier {self.brier():.4f} over {self.resolved:,} predictions; {bins}"

    def _resolve(self, ps: np.ndarray, returned: bool) -> None:
        if not len(ps):
            return
        self._pending_total -= len(ps)
        i = np.minimum((ps * self.bins).astype(int), self.bins - 1)
        self._count += np.bincount(i, minlength=self.bins)
        self._sum_p += np.bincount(i, weights=ps, minlength=self.bins)
        if returned:
            self._sum_hit += np.bincount(i, minlength=self.bins)
        self._squared_error += float(np.sum((ps - float(returned)) ** 2))


@dataclass
class Regret:
    """Sum of a policy's realised restore seconds against the oracle's on the same replay."""

    policy_s: float = 0.0
    oracle_s: float = 0.0

    def add(self, policy_s: float, oracle_s: float) -> None:
        self.policy_s += policy_s
        self.oracle_s += oracle_s

    @property
    def regret_s(self) -> float:
        return self.policy_s - self.oracle_s

    @property
    def ratio(self) -> float:
        """Policy cost over oracle cost (1 = as good as knowing the future)."""
        if self.oracle_s == 0:
            return 1.0 if self.policy_s == 0 else float("inf")
        return self.policy_s / self.oracle_s
