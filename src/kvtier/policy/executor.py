"""The one interpreter of a policy's actions, shared by the engine and the simulator.

A policy returns `Keep`/`Move`/`Drop` (`actions.py`); `ActionExecutor.run` decides, action by
action and chunk by chunk, what each one means for a `ChunkTarget`: the engine's tiered
connector (`kvtier.cache.chunk_actions`) or the simulator's size-only store
(`kvtier.sim.chunk_actions`). Both sides thus read an action the same way, and only the mechanics of
a copy differ.

The rules, in the policy's vocabulary (session id, chunk index, tier name, form):

- `Keep` is counted, nothing else.
- An action naming a session the target does not know is skipped (`unknown_session`).
- `chunk_idx=None` means every chunk of the session that is stored somewhere (the device or a
  lower tier); a chunk stored nowhere has nothing to move or drop.
- An index outside the session's chunks is skipped (`bad_chunk`).
- `Move` of a chunk stored nowhere is skipped (`not_stored`); to the tier it is already in is
  nothing; to the device, to a tier the target lacks (`move_target`) or to a faster tier than
  the chunk's (`move_up`) is skipped: policies only demote, a chunk goes up when a request
  restores it.
- `Drop` of a chunk stored nowhere is nothing.
- Everything else goes to the target: `move` or `drop` of one chunk. After the last action,
  `flush` lets the target start what it batched (the simulator writes one spill per tier).

Budgets are the policy's obligation: it orders its actions so that each one only uses space
that exists at its point in the list (`ledger.Ledger` checks that); the executor does not
check sizes. A target may still refuse a move (blocks in use by a request, a copy that does
not fit): `move` then says why, and the executor counts that reason as a skip. What a refused
move leaves behind is the target's rule, stated in its `move` (the engine keeps the chunk where
it is; the simulator drops one that does not fit). A failure after the target accepted a move
(a tier's write failing later) only means the chunk is recomputed when it is needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvtier.policy.actions import Action, Drop, Keep, Move
from kvtier.vocab import DEVICE


class ChunkTarget(Protocol):
    """Where a session's chunks are and how to move or drop one; the executor's only view of
    a store."""

    @property
    def tiers(self) -> Sequence[str]:
        """The lower tiers that exist, fastest first (the device is above them all)."""
        ...

    def chunks(self, session_id: str) -> Sequence[str | None] | None:
        """The tier of each chunk of the session in order (None: stored nowhere), or None for
        a session the target does not know. Read at the time of each chunk's action, so a
        lazy sequence may look each one up when asked."""
        ...

    def move(self, session_id: str, index: int, tier: str, form: str) -> str | None:
        """Move one stored chunk down to `tier`, kept at most as precise as `form`. None when
        done (or queued); otherwise the reason it was refused, counted as a skip."""
        ...

    def drop(self, session_id: str, index: int) -> None:
        """Free one stored chunk everywhere; a later turn recomputes it."""
        ...

    def flush(self) -> None:
        """The actions of one decision are all given: start what was batched."""
        ...


class ActionExecutor:
    """Runs policy actions on one target and counts what it decided.

    `decisions`: actions by kind (`keep`, `move`, `drop`; a Move or Drop counts once however
    many chunks it names). `skipped`: chunk actions (or whole actions, for an unknown session)
    not carried out, by reason."""

    def __init__(self, target: ChunkTarget) -> None:
        self.target = target
        self.decisions: Counter[str] = Counter({"keep": 0, "move": 0, "drop": 0})
        self.skipped: Counter[str] = Counter()

    def run(self, actions: Iterable[Action]) -> None:
        """Carry out `actions` in list order, then flush the target."""
        rank = {DEVICE: 0} | {name: i + 1 for i, name in enumerate(self.target.tiers)}
        for action in actions:
            self._execute(action, rank)
        self.target.flush()

    def _execute(self, action: Action, rank: dict[str, int]) -> None:
        if isinstance(action, Keep):
            self.decisions["keep"] += 1
            return
        tiers = self.target.chunks(action.session_id)
        if tiers is None:
            self.skipped["unknown_session"] += 1
            return
        self.decisions["move" if isinstance(action, Move) else "drop"] += 1
        if action.chunk_idx is None:
            indices: Iterable[int] = [i for i, tier in enumerate(tiers) if tier is not None]
        else:
            indices = [action.chunk_idx]
        for index in indices:
            if not 0 <= index < len(tiers):
                self.skipped["bad_chunk"] += 1
            elif isinstance(action, Drop):
                if tiers[index] is not None:
                    self.target.drop(action.session_id, index)
            else:
                self._move(action, index, tiers[index], rank)

    def _move(self, action: Move, index: int, source: str | None, rank: dict[str, int]) -> None:
        if source is None:
            self.skipped["not_stored"] += 1
            return
        if action.tier == source:
            return
        if action.tier == DEVICE or action.tier not in rank:
            self.skipped["move_target"] += 1
            return
        if rank[action.tier] < rank[source]:
            self.skipped["move_up"] += 1
            return
        refused = self.target.move(action.session_id, index, action.tier, action.form)
        if refused is not None:
            self.skipped[refused] += 1
