"""The cost policy's LRU tail: KV of sessions idle past the predictor's cut-off age.

The predictor counts a session idle past `max_age_s` as never returning, so its chunks are
worth nothing by the cost model (no return chance left to save anything) and would be
dropped. But a drop from a tier with room buys nothing either: the space is paid for anyway,
and some sessions do come back after the cut-off. So such KV stays where it is, unpriced,
while its tier has room left after every priced chunk is placed, and it is the first thing
evicted when space is needed, oldest idle first (within a session, leading chunks first: they
are the cheapest to recompute). An evicted chunk goes to the next tier down with room left,
like `offload`'s cascade, where it joins that tier's own such chunks in the same idle order;
it skips a tier it is cheaper to recompute than to load from (its remaining value there is
none), and is dropped past the last one. Under pressure the oldest of those evicted from the
device, up to the device's shortage, are dropped at once: the request that asked for the space
waits until that much is off the device, and the model gives such a chunk no chance of saving
anything to set against that wait. The rest (space the policy frees beyond the shortage, for
arrivals it forecasts) are demoted as on the timer, when nobody waits.

These sessions are not priced: the policy's work per decision stays with the sessions that
may still return, however many sessions an ample pool has seen. They are kept in idle-since
order by `SessionTable.past_cutoff`, as rows of its chunk pool.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.policy.actions import Action, Drop, Move
from kvtier.policy.cost_model import CostModel
from kvtier.policy.forms import FormChooser
from kvtier.policy.view import TIER_RANK, SessionView
from kvtier.vocab import DEVICE


@dataclass(frozen=True)
class PastChunks:
    """The chunks of sessions idle past the cut-off, one row each, in eviction order: oldest
    idle session first (ties in session-id order), its chunks in index order."""

    sessions: Sequence[SessionView]
    row_session: np.ndarray  # which of `sessions` each row is a chunk (or unit) of
    position: np.ndarray  # the (unit's first) chunk's place among its session's stored chunks
    columns: np.ndarray  # `session_table.COLUMNS`: index, tokens, token_start, bytes, rank, span


@dataclass(frozen=True)
class PastCutoff:
    """What the sessions idle past the cut-off hold: bytes per tier, known at every decision,
    and their chunks, read only when some must go (an ample pool can hold thousands of such
    sessions that every decision would otherwise gather and then leave where they are)."""

    by_rank: np.ndarray  # bytes held per tier rank (`TIER_RANK`)
    read: Callable[[], PastChunks]  # their chunks, valid until the table's next sync

    def held(self, tiers: Sequence[str]) -> dict[str, int]:
        """Bytes these sessions hold per tier."""
        return {tier: int(self.by_rank[TIER_RANK[tier]]) for tier in tiers}


def evict(
    past: PastCutoff,
    room: Mapping[str, float],
    tiers: Sequence[str],
    model: CostModel,
    forms: FormChooser | None,
    shortage: float = 0.0,
) -> tuple[list[Action], list[tuple[int, Action]]]:
    """(drops, moves keyed by minus their source tier's rank) that fit `past`'s chunks in the
    `room` each tier has left once the priced chunks are placed (see the module docstring).
    The oldest device evictions up to `shortage` bytes (what a waiting request needs freed)
    are dropped. Nothing when every tier has room for the chunks it holds."""
    held = past.held(tiers)
    if all(held[tier] <= room[tier] for tier in tiers):
        return [], []
    chunks = past.read()
    size = chunks.columns[:, 3]
    column_of_rank = np.full(len(TIER_RANK), -1)
    for j, tier in enumerate(tiers):
        column_of_rank[TIER_RANK[tier]] = j
    current = column_of_rank[chunks.columns[:, 4].astype(int)]
    target = current.copy()
    carried = np.zeros(0, dtype=np.int64)  # rows evicted from faster tiers, still looking
    recompute = None
    for j, tier in enumerate(tiers):
        if len(carried):
            if recompute is None:
                recompute = model.chunk_recompute_s(chunks.columns[:, 1], chunks.columns[:, 2])
            worth = recompute[carried] > model.load_s(size[carried], tier)
            candidates = np.sort(np.concatenate([np.flatnonzero(current == j), carried[worth]]))
        else:
            candidates = np.flatnonzero(current == j)
        # the newest idle stay: the longest run from the end of the eviction order that fits
        newest_first = np.cumsum(size[candidates][::-1])
        stay = int(np.searchsorted(newest_first, room[tier], side="right"))
        evicted = candidates[: len(candidates) - stay]
        target[candidates[len(candidates) - stay :]] = j
        target[evicted] = -1
        if shortage > 0 and tier == DEVICE:
            # the waiting request would wait for their copies: the oldest, up to the
            # shortage, are dropped (the first chunk reaching it included)
            before = np.cumsum(size[evicted]) - size[evicted]
            evicted = evicted[before >= shortage]
        carried = np.union1d(carried[~np.isin(carried, candidates)], evicted)
    target[carried] = -1
    drops: list[Action] = []
    moves: list[tuple[int, Action]] = []
    span = chunks.columns[:, 5].astype(int).tolist()
    for r in np.flatnonzero(target != current).tolist():
        session = chunks.sessions[chunks.row_session[r]]
        first = chunks.position[r]
        to = int(target[r])
        for chunk in session.stored_chunks()[first : first + span[r]]:  # a unit's chunks
            if to < 0:
                drops.append(Drop(session.session_id, chunk.index))
                continue
            form = chunk.form if forms is None else forms.choose(chunk, tiers[to])
            moves.append(
                (-TIER_RANK[chunk.tier], Move(session.session_id, chunk.index, tiers[to], form))
            )
    return drops, moves
