"""Which sessions hold chunks in each tier, kept up to date between policy decisions.

A policy view lists every tracked session; an LRU policy under pressure wants only the few
hundred with chunks on the device. Sessions hand out a new (frozen) view object whenever
their chunks change, so comparing identities finds what moved since the last decision.
"""

from __future__ import annotations

from kvtier.policy.view import SessionView


class HoldingIndex:
    def __init__(self) -> None:
        self._by_tier: dict[str, dict[str, SessionView]] = {}
        self._seen: dict[str, SessionView] = {}

    def update(self, view: SessionView) -> bool:
        """Record `view` as the session's current state (cheap when nothing changed). True
        when it is another view object than the one recorded (or the session is new)."""
        old = self._seen.get(view.session_id)
        if old is view:
            return False
        if old is not None:
            for tier in old.tiers_held():
                del self._by_tier[tier][view.session_id]
        for tier in view.tiers_held():
            self._by_tier.setdefault(tier, {})[view.session_id] = view
        self._seen[view.session_id] = view
        return True

    def forget(self, session_id: str) -> None:
        old = self._seen.pop(session_id, None)
        if old is not None:
            for tier in old.tiers_held():
                del self._by_tier[tier][session_id]

    def snapshot(self) -> dict[str, tuple[SessionView, ...]]:
        """What `PolicyView.holding` takes: per tier, the sessions holding chunks there."""
        return {tier: tuple(held.values()) for tier, held in self._by_tier.items() if held}
