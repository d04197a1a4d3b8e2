"""LRU offload that frees a session's KV as soon as its client closes the session.

SGLang's sessions (`/open_session`, `/close_session`) release a closed session's KV from the
radix tree at once, and its eviction then works on what is left. This is that rule as a
baseline: every idle session whose latest hint says `close` has its KV dropped from every
tier; the rest follows `offload`'s LRU cascade. Without close hints it decides as `offload`
does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.policy.actions import Action, Drop
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.ledger import Ledger
from kvtier.policy.lru import make_room
from kvtier.policy.view import PolicyView

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.cost_model import CostModel


@dataclass
class CloseAwareLruPolicy(RetentionPolicy):
    watermark: float = 0.9
    name = "close-lru"

    def __post_init__(self) -> None:
        if not 0 < self.watermark <= 1:
            raise ValueError(f"watermark is a share of capacity in (0, 1], not {self.watermark}")

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        return cls(watermark=config.offload.watermark)

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        ledger = Ledger(view)
        actions: list[Action] = []
        closed = [s for s in view.candidates(now) if s.hints.close]
        for session in sorted(closed, key=lambda s: s.session_id):  # whatever the view's order
            for chunk in session.stored_chunks():
                drop = Drop(session.session_id, chunk.index)
                ledger.apply(drop)
                actions.append(drop)
        for tier in view.tiers:
            need = ledger.used(tier.name) - int(self.watermark * tier.capacity_bytes)
            if tier.name == "device":
                need = max(need, view.bytes_needed - ledger.free("device") if view.pressure else 0)
            actions += make_room(view, ledger, now, tier.name, need, view.tier_names)
        return actions
