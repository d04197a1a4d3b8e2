"""The clairvoyant bound for replays: it is told when every session will come back."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.errors import KvtierError
from kvtier.policy.actions import Action
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.ledger import ChunkKey, placement_actions, room
from kvtier.policy.view import TIER_RANK, PolicyView

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.cost_model import CostModel


@dataclass
class OraclePolicy(RetentionPolicy):
    """Belady's MIN ("A study of replacement algorithms for a virtual-storage computer", IBM
    Systems Journal, 1966) over tiers: chunks of sessions that return soonest get the fastest
    tier with room, later chunks of a session before earlier ones (they are dearer to
    recompute), and sessions that never return are dropped. The device keeps room for the
    waiting queue. Like the other policies it never promotes, so it bounds what a retention
    policy can do, not what prefetching adds. Benchmark only: it needs the future.

    `next_arrivals` maps a session id to the arrival times of its future turns, sorted."""

    next_arrivals: Mapping[str, Sequence[float]] = field(default_factory=dict)
    name = "oracle"

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        raise KvtierError(
            "the oracle policy needs the future arrivals of a replayed trace; the replay "
            "builds it as OraclePolicy(next_arrivals), it cannot come from configuration"
        )

    def next_return(self, session_id: str, now: float) -> float:
        times = self.next_arrivals.get(session_id, ())
        i = bisect.bisect_right(times, now)
        return times[i] if i < len(times) else math.inf

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        sessions = sorted(view.candidates(now), key=lambda s: s.session_id)
        available = room(view, sessions)
        if "device" in available:
            reserve = view.bytes_needed if view.pressure else 0
            available["device"] -= max(reserve, view.waiting_bytes)
        order = sorted(
            (self.next_return(session.session_id, now), -chunk.index, session.session_id, chunk)
            for session in sessions
            for chunk in session.stored_chunks()
        )
        target: dict[ChunkKey, str | None] = {}
        for returns_at, _, session_id, chunk in order:
            key = (session_id, chunk.index)
            target[key] = None
            if returns_at == math.inf:
                continue
            for tier in view.tier_names:
                if TIER_RANK[tier] >= TIER_RANK[chunk.tier] and chunk.size_bytes <= available[tier]:
                    available[tier] -= chunk.size_bytes
                    target[key] = tier
                    break
        return placement_actions(sessions, target)
