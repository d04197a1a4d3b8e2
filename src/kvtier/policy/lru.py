"""Least-recently-used victim choice and the demotion cascade the baseline policies share.

Within a session the leading chunks go first: attention makes a chunk's recompute cost grow
with its position, and a later turn can recompute a dropped front while the rest is still
stored (chunk keys are content hashes of token ids, so a stored chunk stays findable).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

from kvtier.policy.actions import Action, Drop, Move
from kvtier.policy.ledger import ChunkKey, Ledger
from kvtier.policy.view import ChunkView, PolicyView


def lru_order(view: PolicyView, now: float, tier: str) -> Iterator[tuple[ChunkKey, ChunkView]]:
    """Chunks in `tier` a policy may move, first victim first: lower priority, then older
    access, then front chunks; session id breaks ties so the order is deterministic. Lazy: a
    plan usually takes a few victims from a tier holding thousands of chunks, so this merges
    the sessions' own oldest-first lists (cached on their views) through a heap of one entry
    per session."""
    heap = []
    for session in view.candidates_in(tier, now):
        chunks = session.oldest_first(tier)
        if chunks:
            first = chunks[0]
            sid = session.session_id
            heap.append((session.priority, first.last_access, sid, first.index, 0, chunks))
    heapq.heapify(heap)  # (session id, index) is unique, so the last two are never compared
    while heap:
        priority, _, session_id, index, position, chunks = heap[0]
        yield (session_id, index), chunks[position]
        position += 1
        if position < len(chunks):
            after = chunks[position]
            entry = (priority, after.last_access, session_id, after.index, position, chunks)
            heapq.heapreplace(heap, entry)
        else:
            heapq.heappop(heap)


def make_room(
    view: PolicyView,
    ledger: Ledger,
    now: float,
    tier: str,
    need_bytes: int,
    chain: Sequence[str],
) -> list[Action]:
    """Free `need_bytes` in `tier` by moving its LRU chunks to the next tier of `chain`, making
    room there the same way; the last tier of the chain drops. Applies the actions to `ledger`
    and returns them deepest tier first, the order the store must run them in. Frees less when
    too few chunks are movable (the rest belongs to active, pinned or TTL-held sessions)."""
    if need_bytes <= 0:
        return []
    victims: list[tuple[ChunkKey, ChunkView]] = []
    freed = 0
    for key, chunk in lru_order(view, now, tier):
        if ledger.tier_of(key) != tier:
            continue  # already moved by an earlier step of this plan
        victims.append((key, chunk))
        freed += chunk.size_bytes
        if freed >= need_bytes:
            break
    position = chain.index(tier)
    below = chain[position + 1] if position + 1 < len(chain) else None
    actions: list[Action] = []
    if below is not None:
        actions += make_room(view, ledger, now, below, freed - ledger.free(below), chain)
    for (session_id, index), chunk in victims:
        action: Action
        if below is not None and ledger.free(below) >= chunk.size_bytes:
            action = Move(session_id, index, below, chunk.form)
        else:
            action = Drop(session_id, index)
        ledger.apply(action)
        actions.append(action)
    return actions
