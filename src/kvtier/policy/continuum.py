"""Pin the KV of a turn that ended in a tool call for the tool's predicted run time, then LRU.

Continuum (Li et al., "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with
KV Cache Time-to-Live", arXiv 2511.02230) keeps an agent's KV on the GPU while its tool runs,
for a time-to-live set from the tool's predicted duration, because the agent comes back when
the tool returns and a reload (or a recompute) would sit on its critical path. This is that
rule as a baseline: a session whose last reply called a tool is held on the device for the
`quantile` of that tool's recent run times (its gaps, learned online per tool name), or for
`hint_margin` times the client's `expect_return_s` hint where one is given; a prediction
longer than `max_ttl_s` pins nothing (a test run of minutes is not worth the memory). Every
other session's KV follows `offload`'s LRU cascade. Pins give way under pressure: when the
device cannot free what a waiting request needs from unpinned KV, pinned KV goes too, oldest
first, so a pin never blocks the queue.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from kvtier.policy.actions import Action
from kvtier.policy.ledger import Ledger
from kvtier.policy.lru import make_room
from kvtier.policy.offload import OffloadPolicy
from kvtier.policy.view import PolicyView, SessionView

MAX_TOOLS = 256  # tool names remembered (least recently seen forgotten): bounded memory
RUNS_PER_TOOL = 256  # recent run times kept per tool


@dataclass
class ToolRunTimes:
    """Recent run times per tool name, read off the views: the gap after a turn that called
    the tool is its run time. Remembers how many turns of each session it has read."""

    prior_s: float = 5.0  # a tool's TTL before `min_samples` of its runs are seen
    min_samples: int = 4
    _runs: OrderedDict[str, deque[float]] = field(default_factory=OrderedDict)
    _seen: dict[str, int] = field(default_factory=dict)

    def observe(self, sessions: tuple[SessionView, ...]) -> None:
        present = set()
        for session in sessions:
            present.add(session.session_id)
            turns = session.turns
            seen = self._seen.get(session.session_id, len(turns))
            for i in range(max(seen, 1), len(turns)):
                before = turns[i - 1]
                if before.end == "tool_call" and before.tool and before.finished is not None:
                    self._record(before.tool, turns[i].arrival - before.finished)
            self._seen[session.session_id] = len(turns)
        for gone in set(self._seen) - present:
            del self._seen[gone]

    def _record(self, tool: str, seconds: float) -> None:
        runs = self._runs.pop(tool, None) or deque(maxlen=RUNS_PER_TOOL)
        runs.append(max(0.0, seconds))
        self._runs[tool] = runs
        while len(self._runs) > MAX_TOOLS:
            self._runs.popitem(last=False)

    def quantile(self, tool: str, q: float) -> float:
        runs = self._runs.get(tool)
        if runs is None or len(runs) < self.min_samples:
            return self.prior_s
        return float(np.quantile(np.fromiter(runs, float, len(runs)), q))


@dataclass
class ContinuumPolicy(OffloadPolicy):
    quantile: float = 0.9
    max_ttl_s: float = 120.0
    hint_margin: float = 1.5
    runs: ToolRunTimes = field(default_factory=ToolRunTimes)
    name = "continuum"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.quantile < 1:
            raise ValueError(f"quantile must be in (0, 1), not {self.quantile}")

    def ttl_s(self, session: SessionView) -> float | None:
        """How long the session's KV stays pinned after its last turn; None: not pinned."""
        if session.last_end != "tool_call":
            return None
        expected = session.hints.expect_return_s
        if expected is not None:
            ttl = self.hint_margin * expected
        else:
            ttl = self.runs.quantile(session.turns[-1].tool or "", self.quantile)
        return ttl if ttl <= self.max_ttl_s else None

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        self.runs.observe(view.sessions)
        ledger = Ledger(view)
        actions = self.cascade(self._with_pins(view, now), ledger, now)
        if view.pressure and "device" in view.tier_names:
            # the pins give way rather than hold the queue back
            short = view.bytes_needed - ledger.free("device")
            actions += make_room(view, ledger, now, "device", short, view.tier_names)
        return actions

    def _with_pins(self, view: PolicyView, now: float) -> PolicyView:
        """`view` with each pinned session protected by a TTL override (`SessionView.ttl_s`)
        for its pin's remaining time."""
        sessions = []
        changed = False
        for session in view.sessions:
            ttl = self.ttl_s(session) if session.idle else None
            if ttl is not None and session.idle_s(now) < ttl:
                session = dataclasses.replace(session, ttl_s=max(ttl, session.ttl_s or 0.0))
                changed = True
            sessions.append(session)
        if not changed:
            return view
        return PolicyView(
            tuple(sessions),
            view.tiers,
            view.queue,
            view.bytes_per_token,
            view.reason,
            view.bytes_needed,
        )
