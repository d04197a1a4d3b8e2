"""Clocks: virtual time moves when told, real time sleeps, replay time skips idle stretches."""

from __future__ import annotations

import pytest

from kvtier.clock import RealClock, ReplayClock, VirtualClock


class FakeTime:
    """A wall clock the test controls; `sleep` advances it and records the delay."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.slept: list[float] = []

    def timer(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def test_virtual_clock_moves_only_forward_when_told():
    clock = VirtualClock()
    assert clock.now() == 0.0
    clock.advance(2.5)
    clock.advance_to(10.0)
    clock.sleep_until(4.0)  # already past: stays
    assert clock.now() == 10.0
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_real_clock_sleeps_for_both_waits():
    wall = FakeTime()
    clock = RealClock(timer=wall.timer, sleep=wall.sleep)
    wall.t += 1.0
    assert clock.now() == pytest.approx(1.0)
    clock.sleep_until(3.0)
    clock.advance_to(5.0)
    clock.sleep_until(2.0)
    assert wall.slept == pytest.approx([2.0, 2.0])
    assert clock.now() == pytest.approx(5.0)


def test_replay_clock_skips_idle_time_but_runs_real_time():
    wall = FakeTime()
    clock = ReplayClock(timer=wall.timer, sleep=wall.sleep)
    wall.t += 2.0  # a request runs for 2 s of wall time
    clock.advance_to(600.0)  # nothing running until the next arrival: jump
    assert clock.now() == pytest.approx(600.0)
    assert clock.skipped_s == pytest.approx(598.0)
    assert wall.slept == []
    clock.sleep_until(601.5)  # work in flight: wait for real
    assert wall.slept == pytest.approx([1.5])
    assert clock.now() == pytest.approx(601.5)
