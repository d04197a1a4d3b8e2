"""Where `now` comes from, for every part of kvtier: real, simulated, or real with idle time
skipped. Readers (the engine's session tracker, the policy runner; policies themselves never
read a clock, they get `now` as an argument) need only `Clock.now()`. Drivers (the bench replay,
the simulator) also move time, through `DrivenClock`, in trace seconds (0 = replay start):

- `now()`;
- `sleep_until(t)`: wait while work may run until trace time `t` (real clocks sleep);
- `advance_to(t)`: nothing is running until `t` (the caller knows it), so get there as cheaply
  as the clock allows: a virtual or replay clock jumps, a real clock has to sleep.

`ReplayClock` is what compresses idle time in a benchmark: when no request is in flight the
driver calls `advance_to(next_arrival)` and the hours between sessions of a trace take no wall
time, while everything that does run is timed for real. No threads: the single-threaded driver
loop asks the clock, and the clock never calls back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic timeline; only differences matter."""
        ...


class DrivenClock(Clock, Protocol):
    def sleep_until(self, t: float) -> None: ...

    def advance_to(self, t: float) -> None: ...


class VirtualClock:
    """Simulated time: it moves only when told to (the simulator adds modelled costs)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        """Jump to `t`; a time already passed leaves the clock where it is."""
        self._now = max(self._now, t)

    sleep_until = advance_to


class RealClock:
    """Wall time since construction (monotonic), plus `start`."""

    def __init__(
        self,
        start: float = 0.0,
        timer: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._timer = timer
        self._sleep = sleep
        self._origin = timer() - start

    def now(self) -> float:
        return self._timer() - self._origin

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            self._sleep(delay)

    def advance_to(self, t: float) -> None:
        self.sleep_until(t)


class ReplayClock(RealClock):
    """Real time in which idle stretches are skipped: `advance_to` jumps instead of sleeping
    and counts what it skipped, so trace time = wall time + skipped_s."""

    def __init__(
        self,
        start: float = 0.0,
        timer: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(start, timer, sleep)
        self.skipped_s = 0.0

    def now(self) -> float:
        return super().now() + self.skipped_s

    def advance_to(self, t: float) -> None:
        self.skipped_s += max(0.0, t - self.now())
