"""Drop a session's KV the moment it goes idle."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.policy.actions import Action, Drop
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.view import PolicyView


@dataclass
class RecomputePolicy(RetentionPolicy):
    """Free every idle session's KV at once and re-prefill the whole history when it returns:
    the behaviour of an engine without cross-turn caching, the baseline CachedAttention
    (Gao et al., USENIX ATC'24) measures against."""

    name = "recompute"
    spills_on_evict = False  # it never reads a tier

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        sessions = sorted(view.candidates(now), key=lambda s: s.session_id)
        return [Drop(session.session_id) for session in sessions]
