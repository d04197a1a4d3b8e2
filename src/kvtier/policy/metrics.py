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
import heapq
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
class Calibration:
    """Predicted P(return within horizon) against what happened. Predictions wait until the
    session returns or the horizon passes; at most `max_pending` wait (oldest resolved first,
    as not returned), so memory is bounded."""

    bins: int = 10
    max_pending: int = 100_000
    _pending: dict[str, deque[tuple[float, float, float]]] = field(
        default_factory=lambda: defaultdict(deque)
    )
    _count: list[int] = field(init=False)
    _sum_p: list[float] = field(init=False)
    _sum_hit: list[int] = field(init=False)
    _squared_error: float = 0.0
    _pending_total: int = 0
    # (deadline, order made, sessions): which sessions have a prediction due, soonest first, so
    # `expire` visits only those (sessions whose prediction was resolved by a return are
    # skipped); the predictions of one decision share an entry
    _due: list[tuple[float, int, tuple[str, ...]]] = field(default_factory=list)
    _made: int = 0

    def __post_init__(self) -> None:
        self._count = [0] * self.bins
        self._sum_p = [0.0] * self.bins
        self._sum_hit = [0] * self.bins

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
        ps: Sequence[float],
    ) -> None:
        """`predict` for each session in order, all made at once (one decision's): they
        share one entry of the due heap."""
        deadline = made_at + horizon_s
        pending = self._pending
        if self._pending_total + len(session_ids) <= self.max_pending:  # none to evict
            for session_id, p in zip(session_ids, ps, strict=True):
                pending[session_id].append((made_at, deadline, p))
            self._pending_total += len(session_ids)
        else:
            for session_id, p in zip(session_ids, ps, strict=True):
                if self._pending_total >= self.max_pending:
                    oldest = min(pending, key=lambda s: pending[s][0][0])
                    self._resolve(pending[oldest].popleft()[2], False)
                    self._forget_if_empty(oldest)
                pending[session_id].append((made_at, deadline, p))
                self._pending_total += 1
        if session_ids:
            heapq.heappush(self._due, (deadline, self._made, tuple(session_ids)))
            self._made += 1

    def observe(self, events: Iterable[SessionEvent]) -> None:
        for event in events:
            if not isinstance(event, Returned) or event.session_id not in self._pending:
                continue
            queue = self._pending[event.session_id]
            while queue and queue[0][0] < event.at:
                _, deadline, p = queue.popleft()
                self._resolve(p, event.at <= deadline)
            self._forget_if_empty(event.session_id)

    def expire(self, now: float) -> None:
        """Predictions whose horizon ended before `now` without a return were misses."""
        while self._due and self._due[0][0] < now:
            for session_id in heapq.heappop(self._due)[2]:
                queue = self._pending.get(session_id)
                if queue is None:
                    continue
                while queue and queue[0][1] < now:
                    self._resolve(queue.popleft()[2], False)
                self._forget_if_empty(session_id)

    @property
    def resolved(self) -> int:
        return sum(self._count)

    def brier(self) -> float:
        """Mean squared error of the predictions; 0 is perfect, 0.25 is always saying 0.5."""
        return self._squared_error / self.resolved if self.resolved else float("nan")

    def reliability(self) -> list[ReliabilityBin]:
        """Per bin of predicted p: how often sessions really returned (ideal: the diagonal)."""
        out = []
        for i, n in enumerate(self._count):
            if n:
                low, high = i / self.bins, (i + 1) / self.bins
                out.append(ReliabilityBin(low, high, n, self._sum_p[i] / n, self._sum_hit[i] / n))
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

    def _resolve(self, p: float, returned: bool) -> None:
        self._pending_total -= 1
        i = min(int(p * self.bins), self.bins - 1)
        self._count[i] += 1
        self._sum_p[i] += p
        self._sum_hit[i] += int(returned)
        self._squared_error += (p - float(returned)) ** 2

    def _forget_if_empty(self, session_id: str) -> None:
        if not self._pending[session_id]:
            del self._pending[session_id]


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
