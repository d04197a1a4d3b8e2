"""The retention-policy contract: read a view, return actions.

The engine calls `decide` on a timer (`view.reason == "timer"`) and when an allocation fails
(`"pressure"`, with `view.bytes_needed`). A policy must be deterministic given its inputs (and
its seed, where it draws random numbers), must not read clocks, sleep or start threads (time is
the `now` argument), and must keep every tier within budget (see `ledger`). It may keep state
between calls (a learned predictor); that state must depend only on the views it was shown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from kvtier.errors import KvtierError
from kvtier.policy.actions import Action
from kvtier.policy.view import PolicyView

if TYPE_CHECKING:
    from kvtier.policy.config import PolicyConfig
    from kvtier.policy.cost_model import CostModel


class RetentionPolicy(ABC):
    name: ClassVar[str] = ""
    # Whether blocks the device pool evicts are worth copying into a tier first (the default
    # of `tiers.spill_on_evict`, in the engine and the simulator alike): False for a policy
    # that never reads a tier, so a spill would only cost a copy.
    spills_on_evict: ClassVar[bool] = True

    @abstractmethod
    def decide(self, view: PolicyView, now: float) -> list[Action]:
        """Actions for this moment; chunks not mentioned stay where they are."""

    @classmethod
    def from_config(cls, config: PolicyConfig, model: CostModel) -> RetentionPolicy:
        """Build from the validated configuration. Custom policies receive the free-form
        `[policy.options]` table as keyword arguments unless they override this."""
        options: dict[str, Any] = dict(config.options)
        try:
            return cls(**options)
        except TypeError as exc:  # an unknown or missing option, in the user's words
            raise KvtierError(f"policy {config.name!r}: bad [policy.options]: {exc}") from None
