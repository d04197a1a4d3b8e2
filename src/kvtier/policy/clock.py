"""Where `now` comes from. Policies never read a clock themselves: the engine passes the real
one's reading, the simulator and time-compressed replays pass virtual time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic timeline; only differences matter."""
        ...


@dataclass
class ManualClock:
    """Virtual time that moves only when told to (replays, the simulator, tests)."""

    t: float = 0.0

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        if t < self.t:
            raise ValueError(f"time cannot go back from {self.t} to {t}")
        self.t = t
