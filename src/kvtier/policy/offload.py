"""Demote least recently used KV one tier down whenever a tier fills."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.policy.actions import Action
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.ledger import Ledger
from kvtier.policy.lru import make_room
from kvtier.policy.view import PolicyView

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.cost_model import CostModel


@dataclass
class OffloadPolicy(RetentionPolicy):
    """LRU cascade device -> host -> disk -> remote, dropping at the bottom, as in hierarchical
    KV stores: AttentionStore (Gao et al., USENIX ATC'24) spills HBM -> DRAM -> SSD, LMCache
    evicts LRU in each of its GPU/CPU/disk/remote backends. A tier past `watermark` of its
    capacity (or the device under pressure) pushes its LRU chunks down until it is below."""

    watermark: float = 0.9
    name = "offload"

    def __post_init__(self) -> None:
        if not 0 < self.watermark <= 1:
            raise ValueError(f"watermark is a share of capacity in (0, 1], not {self.watermark}")

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        return cls(watermark=config.offload.watermark)

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        return self.cascade(view, Ledger(view), now)

    def cascade(self, view: PolicyView, ledger: Ledger, now: float) -> list[Action]:
        """The LRU cascade over `view`'s movable sessions, applied to `ledger` (policies built
        on this one choose what `view` lets it move)."""
        actions: list[Action] = []
        for tier in view.tiers:
            need = ledger.used(tier.name) - int(self.watermark * tier.capacity_bytes)
            if tier.name == "device":
                need = max(need, view.bytes_needed - ledger.free("device") if view.pressure else 0)
            actions += make_room(view, ledger, now, tier.name, need, view.tier_names)
        return actions
