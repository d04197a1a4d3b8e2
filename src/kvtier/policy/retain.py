"""Keep everything on the device; evict only when an allocation fails."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.policy.actions import Action
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.ledger import Ledger
from kvtier.policy.lru import make_room
from kvtier.policy.view import PolicyView


@dataclass
class RetainPolicy(RetentionPolicy):
    """Retain idle sessions' KV on the device; under pressure drop least recently used chunks,
    to be recomputed if their session returns. This is a paged engine's prefix cache with no
    lower tier: vLLM's automatic prefix caching (Kwon et al., "Efficient Memory Management for
    Large Language Model Serving with PagedAttention", SOSP'23) frees cached blocks LRU-first.
    """

    name = "retain"
    spills_on_evict = False  # it never reads a tier

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        if view.tier("device") is None:
            return []
        ledger = Ledger(view)
        return make_room(view, ledger, now, "device", view.device_shortage(), ("device",))
