"""Budget accounting while a policy plans: what each tier holds as actions apply in order, so no
plan puts more bytes into a tier than it has free plus what the plan frees there first.

Policies that decide a target tier per chunk (cost, oracle) hand the result to
`placement_actions`, which orders the actions so the store can run them one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvtier.plan.kv_dtypes import get_kv_dtype
from kvtier.policy.actions import Action, Drop, Keep, Move
from kvtier.policy.view import TIER_RANK, PolicyView, SessionView

ChunkKey = tuple[str, int]  # (session_id, chunk index)

FULL_BYTES_PER_ELEMENT = 2  # "full" is the model's bf16/fp16 KV


class BudgetError(ValueError):
    """A planned action would overfill a tier or names something the view does not hold."""


def form_bytes(size_bytes: int, from_form: str, to_form: str) -> int:
    """Size of a chunk after converting its form ("full" = 16-bit; others are kv_dtypes names,
    group metadata included)."""
    if from_form == to_form:
        return size_bytes

    def per_element(form: str) -> float:
        if form == "full":
            return FULL_BYTES_PER_ELEMENT
        return float(get_kv_dtype(form).bytes_per_element())

    return round(size_bytes * per_element(to_form) / per_element(from_form))


class Ledger:
    """Where each chunk is and how full each tier is, updated action by action."""

    def __init__(self, view: PolicyView) -> None:
        self._capacity = {tier.name: tier.capacity_bytes for tier in view.tiers}
        self._used = {tier.name: tier.used_bytes for tier in view.tiers}
        # a session's chunks are entered when an action first names it: a plan touches a
        # few sessions of a view that may hold tens of thousands of chunks
        self._sessions = {session.session_id: session for session in view.sessions}
        self._chunks: dict[ChunkKey, tuple[str | None, int, str]] = {}
        self._session_chunks: dict[str, list[int]] = {}

    def _enter(self, session_id: str) -> None:
        if session_id in self._session_chunks or session_id not in self._sessions:
            return
        chunks = self._sessions[session_id].chunks
        self._session_chunks[session_id] = [c.index for c in chunks]
        for chunk in chunks:
            self._chunks[(session_id, chunk.index)] = (chunk.tier, chunk.size_bytes, chunk.form)

    def free(self, tier: str) -> int:
        return max(0, self._capacity[tier] - self._used[tier])

    def used(self, tier: str) -> int:
        return self._used[tier]

    def tier_of(self, key: ChunkKey) -> str | None:
        self._enter(key[0])
        return self._chunks[key][0]

    def apply(self, action: Action) -> None:
        if isinstance(action, Keep):
            return
        for key in self._keys(action.session_id, action.chunk_idx):
            tier, size, form = self._chunks[key]
            if tier is None:
                continue
            if isinstance(action, Drop):
                self._used[tier] -= size
                self._chunks[key] = (None, size, form)
                continue
            if action.tier not in self._capacity:
                raise BudgetError(f"{action} targets tier {action.tier!r}, not in the view")
            new_size = form_bytes(size, form, action.form)
            self._used[tier] -= size
            if self._used[action.tier] + new_size > self._capacity[action.tier]:
                raise BudgetError(
                    f"{action} needs {new_size} B in {action.tier!r}, which has "
                    f"{self.free(action.tier)} B free at that point"
                )
            self._used[action.tier] += new_size
            self._chunks[key] = (action.tier, new_size, action.form)

    def apply_all(self, actions: Iterable[Action]) -> Ledger:
        for action in actions:
            self.apply(action)
        return self

    def _keys(self, session_id: str, chunk_idx: int | None) -> list[ChunkKey]:
        self._enter(session_id)
        if session_id not in self._session_chunks:
            raise BudgetError(f"no session {session_id!r} in the view")
        if chunk_idx is None:
            return [(session_id, index) for index in self._session_chunks[session_id]]
        if (session_id, chunk_idx) not in self._chunks:
            raise BudgetError(f"session {session_id!r} has no chunk {chunk_idx}")
        return [(session_id, chunk_idx)]


def room(view: PolicyView, sessions: Sequence[SessionView]) -> dict[str, int]:
    """Bytes per tier available to re-place `sessions`' chunks: capacity minus everything
    else in the tier, since every one of their chunks is being placed afresh. Negative when
    the tier is over budget even without them."""
    available = {tier.name: tier.capacity_bytes - tier.used_bytes for tier in view.tiers}
    for session in sessions:
        for chunk in session.stored_chunks():
            available[chunk.tier] += chunk.size_bytes
    return available


def placement_actions(
    sessions: Sequence[SessionView], target: Mapping[ChunkKey, str | None]
) -> list[Action]:
    """Actions that take each chunk in `target` to its tier (None = drop), ordered drops first,
    then moves out of the slowest tiers first. Targets are never faster than the source, so
    by the time something moves into a tier, everything leaving that tier has left."""
    drops: list[Action] = []
    moves: list[tuple[int, Action]] = []
    keeps: list[Action] = []
    for session in sorted(sessions, key=lambda s: s.session_id):
        chunks = session.stored_chunks()
        sid = session.session_id
        if chunks and all(target.get((sid, c.index), "") == c.tier for c in chunks):
            keeps.append(Keep(sid))  # one action for a session left where it is
            continue
        for chunk in chunks:
            key = (sid, chunk.index)
            if key not in target:
                continue
            tier = target[key]
            if tier is None:
                drops.append(Drop(session.session_id, chunk.index))
            elif tier == chunk.tier:
                keeps.append(Keep(session.session_id, chunk.index))
            else:
                move = Move(session.session_id, chunk.index, tier, chunk.form)
                moves.append((-TIER_RANK[chunk.tier], move))
    moves.sort(key=lambda item: item[0])  # stable: ties keep session/chunk order
    return drops + [move for _, move in moves] + keeps
