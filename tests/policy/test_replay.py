"""A tiny replay: sessions come and go, a policy runs on its timer and under pressure, and each
resumed turn costs the restore plan's time from wherever its chunks ended up. The oracle, which
knows the arrivals, must do at least as well as every other policy."""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvtier.clock import VirtualClock
from kvtier.policy.base import RetentionPolicy
from kvtier.policy.cost_model import CostModel, CostProfile
from kvtier.policy.cost_policy import CostPolicy
from kvtier.policy.demand import DemandForecast
from kvtier.policy.ledger import Ledger
from kvtier.policy.metrics import PolicyMetrics, Regret
from kvtier.policy.offload import OffloadPolicy
from kvtier.policy.oracle import OraclePolicy
from kvtier.policy.recompute import RecomputePolicy
from kvtier.policy.restore import plan_restore
from kvtier.policy.retain import RetainPolicy
from kvtier.policy.ttl import TtlPolicy
from kvtier.policy.view import ChunkView, PolicyView, SessionView, TierView, TurnView

BYTES_PER_TOKEN = 131_072
CHUNK = 256
SESSION_BYTES = 2048 * BYTES_PER_TOKEN
INTERVAL = 5.0
MODEL = CostModel(CostProfile(prefill_fixed_s=0.01, prefill_token_s=5e-4, prefill_pair_s=5e-8))

# session -> arrival times of its turns (the first opens it with 2,048 tokens, later ones add 256)
WORKLOAD = {
    "s0": [0.0, 20.0, 40.0, 60.0],
    "s1": [1.0, 100.0],
    "s2": [2.0],
    "s3": [3.0, 30.0],
    "s4": [4.0, 200.0],
    "s5": [5.0],
    "s6": [6.0, 50.0, 150.0],
    "s7": [7.0, 120.0],
}
CAPACITY = {"device": 4 * SESSION_BYTES, "host": 2 * SESSION_BYTES}


@dataclass
class _Session:
    turns: list[TurnView] = field(default_factory=list)
    chunks: list[ChunkView] = field(default_factory=list)
    idle_since: float | None = None

    def view(self, session_id: str) -> SessionView:
        return SessionView(
            session_id,
            app_class="chat",
            turns=tuple(self.turns),
            chunks=tuple(self.chunks),
            active=self.idle_since is None,
            idle_since=self.idle_since,
        )


class NoDemand(DemandForecast):
    """This replay charges nothing for spilling at allocation time (no links, no queue), so
    keeping device space free ahead of forecast arrivals could only lose here: the cost policy
    runs without the forecast (tests/policy/test_demand.py and the simulator cover it)."""

    def exceedance(self, horizon_s: float, now: float) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(0), np.zeros(0)


class Replay:
    """Runs `policy` over WORKLOAD; `restore_s` collects each resumed turn's restore time."""

    def __init__(self, policy: RetentionPolicy, capacity: dict[str, int]) -> None:
        self.policy, self.capacity = policy, capacity
        self.clock = VirtualClock()
        self.sessions = {name: _Session() for name in WORKLOAD}
        self.restore_s: list[float] = []
        self.metrics = PolicyMetrics()

    def run(self) -> float:
        events = [(t, 1, name) for name, times in WORKLOAD.items() for t in times]
        end = max(t for t, _, _ in events) + 30.0
        events += [(k * INTERVAL, 2, "") for k in range(int(end / INTERVAL) + 1)]
        heapq.heapify(events)
        while events:
            t, kind, name = heapq.heappop(events)
            self.clock.advance_to(t)
            if kind == 0:
                self._finish(name)
            elif kind == 1:
                self._arrive(name)
                heapq.heappush(events, (t + 2.0, 0, name))  # each turn runs for 2 s
            else:
                self._decide("timer", 0)
        return sum(self.restore_s)

    def _view(self, reason: str, bytes_needed: int) -> PolicyView:
        used = dict.fromkeys(self.capacity, 0)
        for s in self.sessions.values():
            for c in s.chunks:
                if c.tier is not None:
                    used[c.tier] += c.size_bytes
        return PolicyView(
            tuple(s.view(name) for name, s in self.sessions.items() if s.turns),
            tuple(TierView(t, used[t], cap) for t, cap in self.capacity.items()),
            bytes_per_token=BYTES_PER_TOKEN,
            reason=reason,
            bytes_needed=bytes_needed,
        )

    def _decide(self, reason: str, bytes_needed: int) -> PolicyView:
        view = self._view(reason, bytes_needed)
        actions = self.policy.decide(view, self.clock.now())
        self.metrics.record(view, actions)
        ledger = Ledger(view).apply_all(actions)  # budgets hold, or this raises
        for name, s in self.sessions.items():
            s.chunks = [
                dataclasses.replace(c, tier=ledger.tier_of((name, c.index))) for c in s.chunks
            ]
        return self._view("timer", 0)

    def _arrive(self, name: str) -> None:
        now, s = self.clock.now(), self.sessions[name]
        if s.chunks:
            self.restore_s.append(plan_restore(s.chunks, MODEL).seconds)
        s.idle_since = None  # active from here: no policy may touch it while it is restored
        start = s.chunks[-1].token_end if s.chunks else 0
        tokens = 256 if s.turns else 2048
        s.turns.append(TurnView(now, tokens))
        new = [
            ChunkView(len(s.chunks) + i, p, p + CHUNK, None, CHUNK * BYTES_PER_TOKEN)
            for i, p in enumerate(range(start, start + tokens, CHUNK))
        ]
        s.chunks += new
        needed = sum(c.size_bytes for c in s.chunks if c.tier != "device")
        view = self._view("timer", 0)
        if view.tier("device").free_bytes < needed:
            view = self._decide("pressure", needed)
        assert view.tier("device").free_bytes >= needed, f"{self.policy.name} left no room"
        s.chunks = [dataclasses.replace(c, tier="device", last_access=now) for c in s.chunks]

    def _finish(self, name: str) -> None:
        now, s = self.clock.now(), self.sessions[name]
        s.turns[-1] = dataclasses.replace(s.turns[-1], finished=now)
        s.idle_since = now
        s.chunks = [dataclasses.replace(c, last_access=now) for c in s.chunks]


def oracle() -> OraclePolicy:
    return OraclePolicy({name: times for name, times in WORKLOAD.items()})


OTHERS = {
    "retain": RetainPolicy,
    "recompute": RecomputePolicy,
    "offload": OffloadPolicy,
    "ttl": TtlPolicy,
    "cost": lambda: CostPolicy(MODEL, horizon_s=INTERVAL, demand=NoDemand()),
}


@pytest.mark.parametrize("capacity", [CAPACITY, {"device": 3 * SESSION_BYTES}])
@pytest.mark.parametrize("name", OTHERS)
def test_oracle_beats_or_equals_every_policy(name, capacity):
    best = Replay(oracle(), capacity).run()
    replay = Replay(OTHERS[name](), capacity)
    regret = Regret()
    regret.add(replay.run(), best)
    assert regret.regret_s >= -1e-9, f"{name} beat the oracle: {replay.restore_s}"


def test_replay_costs_are_what_the_policies_imply():
    resumes = sum(len(times) - 1 for times in WORKLOAD.values())
    recompute = Replay(RecomputePolicy(), CAPACITY)
    recompute.run()
    assert len(recompute.restore_s) == resumes and min(recompute.restore_s) > 1.0
    best = Replay(oracle(), CAPACITY)
    # with a host tier the oracle keeps nearly every returning session somewhere: loads only
    assert best.run() < 0.05 * sum(recompute.restore_s)
    assert best.metrics.decisions["drop", "device"] > 0  # s2 and s5 never return


@pytest.mark.parametrize(
    "capacity",
    [
        pytest.param(
            CAPACITY,
            marks=pytest.mark.xfail(
                strict=True,
                reason="the censored gap estimate, early in a tiny run (one return among seven "
                "idle sessions at t = 40), takes s6 and s7 as unlikely back, and the pressure "
                "call then drops the s7 chunk that offload keeps on host: 5.685 s against "
                "offload's 4.923 (benchmarks/records/2026-12-02-censored-gaps-merged.md)",
            ),
        ),
        {"device": 3 * SESSION_BYTES},
    ],
)
def test_cost_policy_does_at_least_as_well_as_the_baselines_here(capacity):
    """Within issue 19's 5% of every baseline: with nine resumed turns and a host tier of two
    sessions, which single chunk a pressure call drops decides about 1.5% here (the device's
    keepers ranked over their stay lose one chunk more of s6 at t = 40 than ranked by the next
    interval, 4.997 s against offload's 4.923)."""
    cost = Replay(OTHERS["cost"](), capacity).run()
    for name in ("retain", "recompute", "offload", "ttl"):
        assert cost <= 1.05 * Replay(OTHERS[name](), capacity).run(), name
