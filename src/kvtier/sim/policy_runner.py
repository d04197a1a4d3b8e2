"""PolicyRunner: the retention policy driven by a simulated replica, as the engine's
`kvtier.cache.policy_runner` drives it.

On the replica's timer and under pressure (`run`), it builds a `kvtier.policy.view` snapshot
from cached per-session views (sessions, their chunks and where each lives, tier budgets, the
waiting queue), calls `policy.decide(view, now)` and hands the actions to the shared
`ActionExecutor`, which acts on the replica through `ReplicaChunks` (`chunk_actions.py`). The
sessions a view shows are the tracked ones: a session is tracked from its first turn until it
has been idle without KV for `track_s` (`forget_untracked`).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

from kvtier.policy.base import RetentionPolicy
from kvtier.policy.executor import ActionExecutor, ChunkTarget
from kvtier.policy.metrics import PolicyMetrics
from kvtier.policy.view import PolicyView, QueueView, Reason, TierView, ViewDelta
from kvtier.sim.chunks import Chunks
from kvtier.sim.events import EventLoop
from kvtier.sim.holding import HoldingIndex
from kvtier.sim.pool import DevicePool
from kvtier.sim.requests import SimRequest
from kvtier.sim.session import SimSession


class PolicyRunner:
    def __init__(
        self,
        loop: EventLoop,
        policy: RetentionPolicy,
        target: ChunkTarget,
        pool: DevicePool,
        chunks: Chunks,
        waiting: Sequence[SimRequest],
        bytes_per_token: int,
        track_s: float,
    ) -> None:
        self.loop = loop
        self.policy = policy
        self.pool = pool
        self.chunks = chunks
        self.waiting = waiting  # the replica's queue, read by each view
        self.bytes_per_token = bytes_per_token
        self.track_s = track_s  # idle sessions without KV stay in views this long
        self.metrics = PolicyMetrics()
        # the engine's interpreter of actions, over the replica's size-only store
        self.executor = ActionExecutor(target)
        self.policy_s = 0.0  # wall time spent in the policy's decide(): what the loop waits on
        self.tracked: dict[str, SimSession] = {}  # what policy views show
        self.holding = HoldingIndex()  # of the tracked sessions, who holds KV in which tier
        # what the next view tells the policy changed (`PolicyView.delta`): the sessions no
        # longer tracked since the last view, and that view's token
        self._untracked: list[str] = []
        self._last_view: object = None

    def track(self, session: SimSession) -> None:
        """Show `session` in views from now on (a turn of it arrived)."""
        self.tracked[session.session_id] = session

    def run(self, reason: Reason, bytes_needed: int) -> None:
        """Ask the policy and carry out what it decides."""
        view = self.view(reason, bytes_needed)
        started = time.perf_counter()
        actions = self.policy.decide(view, self.loop.now)
        self.policy_s += time.perf_counter() - started
        self.metrics.record(view, actions)
        self.executor.run(actions)

    def view(self, reason: Reason = "timer", bytes_needed: int = 0) -> PolicyView:
        pool, chunks = self.pool, self.chunks
        tiers = [TierView("device", pool.used - pool.pending_free, pool.capacity)]
        if chunks.store is not None:
            tiers += [
                TierView(
                    name,
                    tier.used_bytes - (chunks.copy_bytes if name == chunks.top_tier else 0),
                    tier.capacity_bytes,
                )
                for name, tier in chunks.store.tiers.items()
            ]
        waiting_bytes = sum(r.reserve - r.device_base - r.allocated for r in self.waiting)
        sessions = tuple(s.view() for s in self.tracked.values())
        # the index compares each session's view object with the last one it saw, which is
        # what the policy would do again: hand it the result
        changed = tuple(itertools.compress(sessions, map(self.holding.update, sessions)))
        left = tuple(sid for sid in self._untracked if sid not in self.tracked)
        self._untracked = []
        view = PolicyView(
            sessions,
            tuple(tiers),
            QueueView(len(self.waiting), math.ceil(waiting_bytes / self.bytes_per_token)),
            bytes_per_token=self.bytes_per_token,
            reason=reason,
            bytes_needed=bytes_needed,
            holding=self.holding.snapshot(),
            delta=ViewDelta(self._last_view, changed, left),
        )
        self._last_view = view.token
        return view

    def forget_untracked(self) -> None:
        """Stop showing the sessions idle without KV for longer than `track_s`."""
        now = self.loop.now
        for session_id, s in list(self.tracked.items()):
            if not s.busy and not s.view().chunks and now - s.idle_since > self.track_s:
                del self.tracked[session_id]
                self.holding.forget(session_id)
                self._untracked.append(session_id)
