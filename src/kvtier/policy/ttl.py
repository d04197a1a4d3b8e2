"""Keep KV in each tier for a configured time, then demote it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.policy.actions import Action, Drop, Move
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.ledger import Ledger
from kvtier.policy.lru import make_room
from kvtier.policy.view import TIER_RANK, TIERS, PolicyView, SessionView

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.cost_model import CostModel

DEFAULT_TTL_S = {"device": 60.0, "host": 600.0, "disk": 3600.0, "remote": 86400.0}


@dataclass
class TtlPolicy(RetentionPolicy):
    """Time-to-live per tier: a chunk unused for longer than the device TTL moves to host,
    after a further host TTL to disk, and so on; past the last it is dropped. TensorRT-LLM's
    KV cache retention config (a priority that lasts a set duration) and LMCache's and cloud
    prompt caches' (OpenAI, Anthropic) expiry times are this idea. A session's `ttl_s`
    override replaces the device TTL. Under pressure it also frees LRU chunks like `offload`.
    """

    seconds: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TTL_S))
    name = "ttl"

    def __post_init__(self) -> None:
        bad = {tier: s for tier, s in self.seconds.items() if tier not in TIERS or s <= 0}
        if bad:
            raise ValueError(f"TTLs must be positive seconds for tiers {TIERS}, got {bad}")

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        return cls(seconds=config.ttl.seconds)

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        ledger = Ledger(view)
        chain = view.tier_names
        actions: list[Action] = []
        expired = []
        for session in view.candidates(now):
            for chunk in session.stored_chunks():
                age = now - chunk.last_access
                target = self._target(session, age, chain)
                # only chunks past their tier's TTL act; a plan only ever moves chunks down,
                # so one whose target is not below where the view has it stays put
                if target is None or TIER_RANK[target] > TIER_RANK[chunk.tier]:
                    expired.append((age, session, chunk, target))
        # oldest first, so when space is short the stalest chunks are the ones that move
        expired.sort(key=lambda item: (-item[0], item[1].session_id, item[2].index))
        for _, session, chunk, target in expired:
            key = (session.session_id, chunk.index)
            current = ledger.tier_of(key)
            if current is None or (target is not None and TIER_RANK[target] <= TIER_RANK[current]):
                continue
            if target is not None:
                actions += make_room(
                    view, ledger, now, target, chunk.size_bytes - ledger.free(target), chain
                )
            action: Action
            if target is not None and ledger.free(target) >= chunk.size_bytes:
                action = Move(session.session_id, chunk.index, target, chunk.form)
            else:
                action = Drop(session.session_id, chunk.index)
            ledger.apply(action)
            actions.append(action)
        if "device" in chain:
            need = view.bytes_needed - ledger.free("device") if view.pressure else 0
            actions += make_room(view, ledger, now, "device", need, chain)
        return actions

    def _target(self, session: SessionView, age: float, chain: tuple[str, ...]) -> str | None:
        """The tier a chunk unused for `age` seconds belongs in; None once every TTL is spent.
        Tiers missing from the chain are skipped, so their time is not spent either."""
        deadline = 0.0
        for tier in chain:
            ttl = self.seconds.get(tier, DEFAULT_TTL_S[tier])
            if tier == "device" and session.ttl_s is not None:
                ttl = session.ttl_s
            deadline += ttl
            if age < deadline:
                return tier
        return None
