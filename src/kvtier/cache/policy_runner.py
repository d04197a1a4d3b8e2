"""PolicyRunner: the retention policy driven by the engine, acting on real blocks.

Every `interval_s` of the engine's clock (the SessionTracker's, so replays run in trace time)
and when the device pool runs short while requests wait, it builds a `kvtier.policy.view`
snapshot (sessions, their chunks and where each lives, tier budgets, the waiting queue), calls
`policy.decide(view, now)` and hands the actions to the shared `ActionExecutor`
(`kvtier.policy.executor`, the simulator's too), which acts on the connector through
`ConnectorChunks` (`chunk_actions.py`: how one chunk moves or is dropped). The view shows each
chunk's form and its size in that form.

The engine thread never waits for a tier here: a write that later fails (or finds the queue
full) only means the chunk is recomputed when it is needed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvtier.cache.chunk_actions import ConnectorChunks, SessionKeys
from kvtier.policy.config import PolicyConfig
from kvtier.policy.executor import ActionExecutor
from kvtier.policy.registry import build_policy
from kvtier.policy.view import (
    ChunkView,
    PolicyView,
    QueueView,
    SessionView,
    TierView,
    TurnView,
)
from kvtier.tiers import Chunk
from kvtier.vocab import DEVICE, FULL

if TYPE_CHECKING:
    from kvtier.cache.connector_parts import ConnectorParts
    from kvtier.engine.sessions import TurnRecord
    from kvtier.policy.actions import Action
    from kvtier.policy.base import RetentionPolicy

log = logging.getLogger(__name__)


class PolicyRunner:
    def __init__(
        self,
        connector: ConnectorParts,
        policy: str | RetentionPolicy,
        config: PolicyConfig | None,
    ) -> None:
        self.connector = connector
        name = policy if isinstance(policy, str) else policy.name or type(policy).__name__
        self.config = (config or PolicyConfig()).model_copy(update={"name": name})
        self.policy_name = name
        self.policy = (
            build_policy(self.config, connector.config.cost_profile)
            if isinstance(policy, str)
            else policy
        )
        self.cost_model = self.config.cost_model(connector.config.cost_profile)
        # the stored forms the policy may choose on disk/remote (full precision only, unless
        # an accuracy budget admits more)
        self.allowed_forms: tuple[str, ...] = (FULL,)
        if self.config.max_accuracy_loss > 0:
            budget = self.config.form_budget()
            self.allowed_forms = budget.allowed
            # a budget that allows nothing (no figures for the model) is worth a warning
            level = logging.WARNING if len(budget.allowed) == 1 else logging.INFO
            log.log(
                level, "stored forms allowed on disk/remote: %s; %s", budget.allowed, budget.note
            )
        self.interval_s = self.config.interval_s
        self.sessions: dict[str, SessionKeys] = {}
        # block key -> how many remembered sessions hold it: blocks shared through the prefix
        # cache (a system prompt, a shared document) are never dropped for one session's sake
        self._holders: Counter[bytes] = Counter()
        self.chunks = ConnectorChunks(connector, self.sessions, self._holders)
        self.executor = ActionExecutor(self.chunks)
        # what the executor decided and skipped, by kind and reason (engine stats show them)
        self.decisions = self.executor.decisions
        self.skipped = self.executor.skipped
        self.runs: Counter[str] = Counter({"timer": 0, "pressure": 0})
        self._last_run: float | None = None
        self._steps_since_pressure = 0

    @property
    def clock(self):
        return self.connector.context.sessions.clock

    def remember_session(self, session_id: str, keys: tuple[bytes, ...], namespace: str) -> None:
        old = self.sessions.get(session_id)
        if old is not None:
            self._holders.subtract(set(old.keys))
        self._holders.update(set(keys))
        self.sessions[session_id] = SessionKeys(keys, namespace)

    # ----- triggers ------------------------------------------------------------------------

    def after_step(self) -> None:
        now = self.clock.now()
        if self._last_run is None:
            self._last_run = now
        if now - self._last_run >= self.interval_s:
            self.run("timer")
            return
        self._steps_since_pressure += 1
        queue = self.connector.context.queue()
        if queue.num_waiting and self._steps_since_pressure >= 8:
            need = -(-queue.head_tokens // self.connector.block_size)
            pool = self.connector.block_pool
            if not (pool.num_free + pool.num_kept) or pool.num_allocatable < need:
                self.run("pressure", need * self.connector.bytes_per_block)

    def run(self, reason: str = "timer", bytes_needed: int = 0) -> list[Action]:
        """Snapshot, decide, execute; returns the actions (tests and tools call it directly)."""
        now = self.clock.now()
        self._last_run = now
        self._steps_since_pressure = 0
        self.runs[reason] += 1
        view = self.view(reason, bytes_needed)
        try:
            actions = self.policy.decide(view, now)
        except Exception:  # a broken policy must not take serving down
            log.exception("policy %s failed to decide", self.policy_name)
            self.skipped["policy_error"] += 1
            return []
        self.executor.run(actions)
        return actions

    def execute(self, action: Action) -> None:
        """One action on its own (tests and benchmarks place chunks with it)."""
        self.executor.run([action])

    # ----- the view ------------------------------------------------------------------------

    def _chunk_views(self, keys: tuple[bytes, ...], namespace: str, last_access: float):
        c = self.connector
        pool = c.block_pool
        views = []
        for index, chunk_keys in enumerate(c.chunk_keys(keys)):
            blocks = [b for b in (pool.resident(k) for k in chunk_keys) if b is not None]
            start = index * c.blocks_per_chunk * c.block_size
            end = start + len(chunk_keys) * c.block_size
            # on device: full-precision bytes, though restored ones keep their lossy form
            tier, form = DEVICE, c.form_of(blocks)
            size = len(blocks) * c.bytes_per_block
            if not blocks:
                where = c.locate_form(Chunk(chunk_keys, namespace).id)
                tier, form = where if where is not None else (None, FULL)
                size = c.chunk_forms.nbytes(len(chunk_keys), form)
            views.append(ChunkView(index, start, end, tier, size, form, last_access))
        return tuple(views)

    def view(self, reason: str = "timer", bytes_needed: int = 0) -> PolicyView:
        c = self.connector
        tracker = c.context.sessions
        self._forget_untracked(tracker.sessions)
        sessions = []
        for session_id, turns in tracker.sessions.items():
            if not turns:
                continue
            last = turns[-1]
            active = last.ended_at is None
            stored = self.sessions.get(session_id)
            chunks: tuple[ChunkView, ...] = ()
            if stored is not None:
                access = last.ended_at if last.ended_at is not None else last.started_at
                chunks = self._chunk_views(stored.keys, stored.namespace, access)
            hints = last.hints
            sessions.append(
                SessionView(
                    session_id=session_id,
                    tenant=stored.namespace if stored else "default",
                    turns=_turn_views(turns),
                    chunks=chunks,
                    active=active,
                    idle_since=None if active else last.ended_at,
                    pinned=hints.pins,
                    priority=hints.priority,
                    ttl_s=hints.ttl_s,
                    hints=hints,
                )
            )
        pool = c.block_pool
        tiers = [
            TierView(
                DEVICE,
                (pool.num_blocks - pool.num_free - pool.num_kept) * c.bytes_per_block,
                pool.num_blocks * c.bytes_per_block,
            )
        ]
        # A tier's copies of chunks placed above it (`disk_copy`) are left out of its use:
        # the policy counts a chunk's bytes where the view places it, and charges a move into
        # the tier with them, which then takes the copy's space.
        tiers += [
            TierView(name, tier.used_bytes - c.store.copy_bytes(name), tier.capacity_bytes)
            for name, tier in c.store.tiers.items()
        ]
        demand = c.context.queue()
        queue = QueueView(demand.num_waiting, demand.num_tokens)
        return PolicyView(
            sessions=tuple(sessions),
            tiers=tuple(tiers),
            queue=queue,
            bytes_per_token=c.bytes_per_block // c.block_size,
            reason="pressure" if reason == "pressure" else "timer",
            bytes_needed=bytes_needed,
        )

    def _forget_untracked(self, tracked: Mapping[str, object]) -> None:
        """Sessions the engine's tracker has forgotten (idle past its expiry) leave the policy's
        sight, so their KV goes too: otherwise it would sit in the tiers with no one to decide
        on it, and this map would grow for as long as the server runs."""
        for session_id in [s for s in self.sessions if s not in tracked]:
            stored = self.sessions.pop(session_id)
            self._holders.subtract(set(stored.keys))
            for chunk in self.connector.chunk_keys(stored.keys):
                self.chunks.drop_keys(chunk, stored.namespace, holders=0)
            self.decisions["forgotten"] += 1


def _turn_views(turns: Sequence[TurnRecord]) -> tuple[TurnView, ...]:
    """The view's turns, each with the tokens it added to the session's context, as the
    contract defines `TurnView.prompt_tokens` (the simulator's too). The engine knows each
    turn's whole prompt, which resends the history: turn k added its prompt minus turn k-1's
    (the new message and turn k-1's reply, which the engine sees once it is resent), so the
    turns sum to the latest prompt. Counting whole prompts made a session's k-th turn look
    k times its context to the cost policy's demand forecast, which then demoted idle KV
    from a device that had room for it."""
    views, before = [], 0
    for t in turns:
        added = max(0, t.num_prompt_tokens - before)
        views.append(TurnView(t.started_at, added, t.ended_at, t.end, t.tool))
        before = t.num_prompt_tokens
    return tuple(views)
