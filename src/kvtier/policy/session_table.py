"""The cost policy's pricing state, kept between decisions in arrays updated in place.

One slot per session of the view holds what decides whether it is a candidate (pinned, idle,
TTL, idle since), its priority weight, a whole-session `Keep` made once, and what it was last
priced at (its return schedule q and d, the tier prices, the fastest tier holding one of its
chunks). One row per pricing unit, in a pool shared by all sessions, holds the unit's columns
(first chunk's index, tokens, first token, bytes, tier rank, chunks) and, once priced, its
values and what a return saves per tier. A unit is a run of at most `unit` chunks of the
session with consecutive indices in one tier (`chunk_columns_many`); with `unit` 1, a chunk.
A decision takes in the sessions whose view changed (`view_diff`), loads the columns of those
that are candidates, and does the rest as array passes over the slots and the pool: which
sessions are candidates, their order, their rows, which of them must be priced again.
Before this, each decision handed out every session's arrays in Python and concatenated them.
Sessions idle past `max_age_s` are not candidates: `past_cutoff` hands them out, oldest idle
first, for the policy's LRU tail (`past_cutoff.py`).

A session's rows are reused while its view is the same object; a view with as many rows or
fewer overwrites them in place, a larger one takes fresh rows at the end of the pool, and the
pool is compacted when it runs out with half of it dead.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

from kvtier.policy.actions import Keep
from kvtier.policy.kernels import merge_units, stale_rows
from kvtier.policy.key_codes import KeyCodes, KeyGroups
from kvtier.policy.past_cutoff import PastChunks, PastCutoff
from kvtier.policy.view import TIER_RANK, PolicyView, SessionView
from kvtier.policy.view_diff import Changes

COLUMNS = 6  # index, tokens, token_start, bytes, tier rank, chunks (a unit's span)
# with a tolerance, return probabilities this close (absolute) also count as unchanged: a
# relative tolerance alone would re-price a session whose 1e-6 chance became 2e-6
Q_FLOOR = 1e-4
# codes of keys no live session has, kept until they outnumber the live sessions' by this
KEYS_SLACK = 1024


# index, token_end, token_start, bytes: read one attribute over all chunks at a time (a
# tuple per chunk costs more)
_FIELDS = tuple(map(attrgetter, ("index", "token_end", "token_start", "size_bytes")))
_TIER = attrgetter("tier")


def chunk_columns(session: SessionView, unit: int = 1) -> np.ndarray:
    """One row per pricing unit of the session's stored chunks (`chunk_columns_many`)."""
    return chunk_columns_many([session], unit)[0]


def chunk_columns_many(sessions: list[SessionView], unit: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(the sessions' pricing units one after another, one row each: its first chunk's index,
    its tokens, its first token, its bytes, its tier's rank and how many chunks it has; how
    many rows each session has). A unit is a run of at most `unit` chunks of one session with
    consecutive indices in one tier, priced and placed as one: with `unit` 1, one row per
    chunk."""
    stored = list(map(SessionView.stored_chunks, sessions))
    counts = np.fromiter(map(len, stored), np.int64, len(stored))
    chunks = list(chain.from_iterable(stored))
    out = np.empty((len(chunks), COLUMNS))
    for column, field in enumerate(_FIELDS):  # index, token_end, token_start, bytes
        out[:, column] = np.fromiter(map(field, chunks), float, len(chunks))
    out[:, 1] -= out[:, 2]  # tokens; exact: token counts are far below 2**53
    out[:, 4] = np.fromiter(map(TIER_RANK.__getitem__, map(_TIER, chunks)), float, len(chunks))
    out[:, 5] = 1.0
    if unit == 1 or len(chunks) < 2:
        return out, counts
    return _units(out, counts, unit)


def _units(out: np.ndarray, counts: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """`chunk_columns_many`'s rows of single chunks merged into units of at most `unit`
    (compiled: `kernels.merge_units`)."""
    merged = np.empty_like(out)
    units = np.empty(len(counts), dtype=np.int64)
    n = merge_units(out, np.ascontiguousarray(counts, dtype=np.int64), unit, merged, units)
    return merged[:n], units


def chunk_positions(span: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Each row's first chunk's place among its session's stored chunks, for rows of `span`
    chunks each, `count[i]` rows per session i in turn."""
    ends = np.cumsum(span.astype(np.int64))
    before = ends - span.astype(np.int64)
    session_first = np.cumsum(count) - count  # each session's first row
    return before - np.repeat(before[session_first[count > 0]], count[count > 0])


def ranges(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The concatenation of arange(first[i], first[i] + count[i]) over i."""
    total = int(count.sum())
    offsets = np.cumsum(count) - count
    return np.repeat(first - offsets, count) + np.arange(total)


@dataclass(frozen=True)
class Candidates:
    """The sessions one decision may act on (idle, not protected, holding KV), in session-id
    order, which is also the tie-break order, and where their chunks are in the pool."""

    sessions: Sequence[SessionView]
    slots: np.ndarray  # each session's slot
    idle_s: np.ndarray  # each session's idle time at the decision
    weight: np.ndarray  # 2 ** priority
    rows: np.ndarray  # pool rows of their chunks, in (session id, chunk index) order
    row_session: np.ndarray  # which of `sessions` each row belongs to
    keeps: Sequence[Keep]  # each session's whole-session Keep
    chunk_keeps: Sequence[dict[int, Keep]]  # each session's per-chunk Keeps made so far
    ids: Sequence[str]  # each session's id
    keys: KeyGroups  # each session's `reuse_key`, grouped


def _pick(items: np.ndarray, at: np.ndarray) -> list:
    """items[at] of a per-slot object array, as a list: one C-level gather (a decision picks
    hundreds to thousands of sessions, three times)."""
    return items.take(at).tolist()


class SessionTable:
    """See the module docstring. `sync` each decision; `stale` / `store` / `values` for the
    pricing of its candidates."""

    def __init__(self, tolerance: float = 0.0, max_age_s: float = math.inf, unit: int = 1) -> None:
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), not {tolerance}")
        if unit < 1:
            raise ValueError(f"a pricing unit is at least one chunk, not {unit}")
        self.tolerance = tolerance
        self.unit = unit  # chunks per row at most (`chunk_columns_many`)
        # sessions idle this long are not candidates: `past_cutoff` hands them out instead
        self.max_age_s = max_age_s
        self._past = np.zeros(0, dtype=np.int64)  # their slots, in session-id order
        self._slot: dict[str, int] = {}
        # per slot, as object arrays (see `_pick`): id, view, whole-session Keep, chunk Keeps
        self._ids = np.empty(0, dtype=object)
        self._views = np.empty(0, dtype=object)
        self._keeps = np.empty(0, dtype=object)
        self._chunk_keeps = np.empty(0, dtype=object)
        # each view's `reuse_key` as a small integer: grouping thousands of candidates by key
        # at every decision is then array passes, not a hash of a tuple per session
        self._keys = KeyCodes()
        self._key_code = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []
        self._sorted: list[str] = []  # the session ids of the slots, sorted
        self._order: np.ndarray | None = None  # slots in session-id order; None: to build
        self._slots = 0
        self._grow_slots(64)
        self._end = 0  # pool rows in use (live or dead)
        self._grow_pool(256)
        self.tiers: tuple[str, ...] = ()
        self._values = np.zeros((len(self._cols), 0))
        self._gain = np.zeros((len(self._cols), 0))
        self._q = np.zeros((len(self._pinned), 0))
        self._d = np.zeros((len(self._pinned), 0))
        self._prices = np.zeros((len(self._pinned), 0))

    # -- slots ---------------------------------------------------------------------------

    def _grow_slots(self, size: int) -> None:
        old = self._slots
        self._slots = size

        def grown(
            array: np.ndarray | None, fill: float | bool, dtype: type, row: tuple[int, ...] = ()
        ) -> np.ndarray:
            shape = (size, *(array.shape[1:] if array is not None else row))
            out = np.full(shape, fill, dtype=dtype)
            if array is not None:
                out[:old] = array[:old]
            return out

        get = self.__dict__.get
        self._pinned = grown(get("_pinned"), True, bool)
        self._idle = grown(get("_idle"), False, bool)
        self._idle_since = grown(get("_idle_since"), np.nan, float)
        self._ttl = grown(get("_ttl"), np.nan, float)
        self._weight = grown(get("_weight"), 1.0, float)
        self._loaded = grown(get("_loaded"), False, bool)  # columns are the view's
        self._first = grown(get("_first"), 0, np.int64)
        self._key_code = grown(get("_key_code"), 0, np.int64)
        self._count = grown(get("_count"), 0, np.int64)
        self._cap = grown(get("_cap"), 0, np.int64)
        self._top = grown(get("_top"), 0.0, float)
        self._priced = grown(get("_priced"), False, bool)
        # bytes of the slot's chunks per tier rank, as loaded
        self._held = grown(get("_held"), 0.0, float, (len(TIER_RANK),))
        for name in ("_q", "_d", "_prices"):
            if name in self.__dict__:
                setattr(self, name, grown(get(name), 0.0, float))
        for name in ("_ids", "_views", "_keeps", "_chunk_keeps"):
            items = np.empty(size, dtype=object)  # None-filled
            items[:old] = getattr(self, name)[:old]
            setattr(self, name, items)

    def _add(self, session: SessionView) -> None:
        if not self._free:
            start = len(self._slot)
            if start == self._slots:
                self._grow_slots(2 * self._slots)
            self._free = list(range(self._slots - 1, start - 1, -1))
        slot = self._free.pop()
        sid = session.session_id
        self._slot[sid] = slot
        self._ids[slot] = sid
        self._keeps[slot] = Keep(sid)
        self._chunk_keeps[slot] = {}
        at = bisect.bisect_left(self._sorted, sid)
        self._sorted.insert(at, sid)
        if self._order is not None:  # kept in step: rebuilding it is a pass over every slot
            self._order = np.insert(self._order, at, slot)
        self._set(slot, session)

    def _remove(self, session_id: str) -> None:
        slot = self._slot.pop(session_id)
        at = bisect.bisect_left(self._sorted, session_id)
        del self._sorted[at]
        if self._order is not None:
            self._order = np.delete(self._order, at)
        self._views[slot] = self._keeps[slot] = self._chunk_keeps[slot] = None
        self._pinned[slot] = True  # never a candidate
        self._loaded[slot] = self._priced[slot] = False
        self._count[slot] = self._cap[slot] = 0
        self._free.append(slot)

    def _set(self, slot: int, session: SessionView) -> None:
        self._views[slot] = session
        self._key_code[slot] = self._keys.code(session.reuse_key)
        self._pinned[slot] = session.pinned
        self._idle[slot] = session.idle
        self._idle_since[slot] = np.nan if session.idle_since is None else session.idle_since
        self._ttl[slot] = np.nan if session.ttl_s is None else session.ttl_s
        self._weight[slot] = 2.0**session.priority
        self._loaded[slot] = self._priced[slot] = False

    # -- the chunk pool --------------------------------------------------------------------

    def _grow_pool(self, size: int) -> None:
        self._cols = np.zeros((size, COLUMNS))
        if "_values" in self.__dict__:
            self._values = np.zeros((size, self._values.shape[1]))
            self._gain = np.zeros((size, self._gain.shape[1]))

    def _load(self, slots: list[int]) -> None:
        """Put the columns of the slots' views in the pool: one read over all their chunks and
        array passes, not a round of numpy calls per session (a decision loads tens)."""
        views = [self._views[s] for s in slots]  # type: ignore[misc]
        columns, counts = chunk_columns_many(views, self.unit)
        at = np.array(slots, dtype=np.int64)
        grows = counts > self._cap[at]  # more chunks than its rows: fresh rows at the end
        needed = int(counts[grows].sum())
        if needed:
            if self._end + needed > len(self._cols):
                self._make_room(needed)
            self._first[at[grows]] = self._end + np.cumsum(counts[grows]) - counts[grows]
            self._cap[at[grows]] = counts[grows]
            self._end += needed
        self._cols[ranges(self._first[at], counts)] = columns
        self._count[at] = counts
        held = counts > 0
        starts = (np.cumsum(counts) - counts)[held]
        ranks = len(TIER_RANK)
        owner = np.repeat(np.arange(len(slots)), counts) * ranks  # exact: whole byte counts
        by_rank = np.bincount(
            owner + columns[:, 4].astype(np.int64), columns[:, 3], len(slots) * ranks
        )
        self._held[at] = by_rank.reshape(len(slots), ranks)
        self._top[at] = 0.0
        self._top[at[held]] = np.minimum.reduceat(columns[:, 4], starts) if len(starts) else 0.0
        self._loaded[at] = True

    def _make_room(self, n: int) -> None:
        """Compact the live rows to the front of the pool, growing it when half of it would
        still be in use."""
        held = np.flatnonzero(self._cap[: self._slots] > 0)
        live = ranges(self._first[held], self._cap[held])
        size = len(self._cols)
        while 2 * (len(live) + n) > size:
            size *= 2
        cols, values, gain = self._cols[live], self._values[live], self._gain[live]
        self._grow_pool(size)
        self._cols[: len(live)], self._values[: len(live)], self._gain[: len(live)] = (
            cols,
            values,
            gain,
        )
        self._first[held] = np.cumsum(self._cap[held]) - self._cap[held]
        self._end = len(live)

    # -- a decision ------------------------------------------------------------------------

    def sync(self, view: PolicyView, changes: Changes, now: float) -> Candidates:
        """Take in the view's `changes` against the previous view given (new, changed and
        departed sessions) and return its candidates."""
        if view.tier_names != self.tiers:  # values are per tier: nothing priced still holds
            self.tiers = view.tier_names
            self._values = np.zeros((len(self._cols), len(self.tiers)))
            self._gain = np.zeros((len(self._cols), len(self.tiers)))
            self._priced[:] = False
        for session_id in changes.left:
            if session_id in self._slot:
                self._remove(session_id)
        slot_of = self._slot
        for session in changes.changed:
            slot = slot_of.get(session.session_id)
            if slot is None:
                self._add(session)
            else:
                self._set(slot, session)
        if len(self._keys) > KEYS_SLACK + 2 * len(self._slot):  # keys of departed sessions
            live = np.fromiter(self._slot.values(), np.int64, len(self._slot))
            self._key_code[live] = self._keys.compact(self._key_code[live])
        return self._candidates(now)

    def _candidates(self, now: float) -> Candidates:
        if self._order is None:
            self._order = np.fromiter(
                map(self._slot.__getitem__, self._sorted), np.int64, len(self._sorted)
            )
        n = self._slots
        idle_s = np.maximum(0.0, now - self._idle_since[:n])
        with np.errstate(invalid="ignore"):  # nan: not idle, or no TTL
            held = idle_s < self._ttl[:n]
        free = ~self._pinned[:n] & self._idle[:n] & ~held  # `SessionView.protected`, negated
        unloaded = np.flatnonzero(free & ~self._loaded[:n]).tolist()
        if unloaded:
            self._load(unloaded)
        holding = free & (self._count[:n] > 0)
        past = holding & (idle_s >= self.max_age_s)
        self._past = self._order[past[self._order]]
        order = self._order[(holding & ~past)[self._order]]
        count = self._count[order]
        return Candidates(
            sessions=_pick(self._views, order),
            slots=order,
            idle_s=idle_s[order],
            weight=self._weight[order],
            rows=ranges(self._first[order], count),
            row_session=np.repeat(np.arange(len(order)), count),
            keeps=_pick(self._keeps, order),
            chunk_keeps=_pick(self._chunk_keeps, order),
            ids=_pick(self._ids, order),
            keys=self._keys.groups(self._key_code[order]),
        )

    def past_cutoff(self) -> PastCutoff:
        """The sessions the last `sync` found idle past `max_age_s` and holding KV (not among
        its candidates): their bytes per tier now, their chunks when asked (oldest idle
        first, with their columns), until the next `sync`."""
        past = self._past
        # whole byte counts: the sum is exact in any order
        return PastCutoff(self._held[past].sum(axis=0), lambda: self._past_chunks(past))

    def _past_chunks(self, past: np.ndarray) -> PastChunks:
        slots = past[np.argsort(self._idle_since[past], kind="stable")]
        count, first = self._count[slots], self._first[slots]
        rows = ranges(first, count)
        columns = self._cols[rows]
        return PastChunks(
            sessions=_pick(self._views, slots),
            row_session=np.repeat(np.arange(len(slots)), count),
            position=chunk_positions(columns[:, 5], count),
            columns=columns,
        )

    def held(self, candidates: Candidates, tiers: Sequence[str]) -> dict[str, int]:
        """Bytes the candidates' chunks hold per tier (whole byte counts: exact in any order)."""
        by_rank = self._held[candidates.slots].sum(axis=0)
        return {tier: int(by_rank[TIER_RANK[tier]]) for tier in tiers}

    def columns(self, candidates: Candidates) -> np.ndarray:
        """The candidates' chunk columns, one row per chunk (see `COLUMNS`)."""
        return self._cols.take(candidates.rows, 0)

    def stale(
        self, candidates: Candidates, q: np.ndarray, d: np.ndarray, prices: np.ndarray
    ) -> np.ndarray:
        """Per candidate, True when its stored values no longer hold: never priced since its
        view changed, an interval length differs from what it was priced at, or a return
        probability, or the price of a tier its chunks may still use (at or below the
        fastest one they are in), has moved from it by more than the table's `tolerance`
        (relative, or `Q_FLOOR` absolute for a probability). With tolerance 0 a reused value
        is the one a fresh pricing would give. Interval lengths are compared exactly: the
        policy conditions a schedule on the idle age's bin edge (`ReusePredictor.age_floor`),
        so they change only when the session crosses one."""
        slots = candidates.slots
        if self._q.shape[1] != q.shape[1] or self._prices.shape[1] != len(prices):
            self._q = np.zeros((self._slots, q.shape[1]))
            self._d = np.zeros((self._slots, q.shape[1]))
            self._prices = np.zeros((self._slots, len(prices)))
            self._priced[:] = False
        ranks = np.array([TIER_RANK[t] for t in self.tiers], dtype=np.int64)
        floor = Q_FLOOR if self.tolerance else 0.0
        out = np.empty(len(slots), dtype=bool)
        stale_rows(
            np.ascontiguousarray(q, dtype=float),
            np.ascontiguousarray(d, dtype=float),
            np.ascontiguousarray(prices, dtype=float),
            ranks,
            np.ascontiguousarray(slots, dtype=np.int64),
            self._q,
            self._d,
            self._prices,
            self._top,
            self._priced,
            float(self.tolerance),
            float(floor),
            out,
        )
        return out

    def store(
        self,
        candidates: Candidates,
        stale: np.ndarray,
        q: np.ndarray,
        d: np.ndarray,
        prices: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Remember what the `stale` candidates are being priced at; returns (the pool rows
        of their chunks in order, the values pool, the pool of what a return saves), both
        [rows, tiers], for the pricing to write their values into."""
        slots = candidates.slots[stale]
        self._q[slots], self._d[slots] = q[stale], d[stale]
        self._prices[slots] = prices
        self._priced[slots] = True
        rows = candidates.rows[stale[candidates.row_session]]
        return rows, self._values, self._gain

    def values(self, candidates: Candidates) -> np.ndarray:
        """The values of the candidates' chunks, [chunks, tiers] (what a return saves is in
        the pool `store` hands out, at `candidates.rows`)."""
        # `take` copies whole rows: several times faster than fancy indexing here
        return self._values.take(candidates.rows, 0)

    def priced(self, session_id: str) -> np.ndarray | None:
        """The values a session's chunks were last priced at, [chunks, tiers] in chunk order;
        None when it is not in the table or not priced since its view changed."""
        slot = self._slot.get(session_id)
        if slot is None or not self._priced[slot]:
            return None
        first = int(self._first[slot])
        return self._values[first : first + int(self._count[slot])].copy()
