"""What a retention policy sees: a frozen snapshot the engine (or the simulator) builds each
time it asks for a decision, on its timer or under memory pressure.

A *chunk* is a run of consecutive blocks of one session that moves between tiers as a unit
(e.g. 256 tokens): device pages are small, but small copies waste link bandwidth. Chunks are
identified by `(session_id, chunk.index)` and cover the session's tokens in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

# TIERS is fastest first; every list of tiers in this package is in this order.
from kvtier.session_hints import NO_HINTS as NO_HINTS  # re-exported: policies name them here
from kvtier.session_hints import EndKind as EndKind
from kvtier.session_hints import SessionHints as SessionHints
from kvtier.vocab import FULL, TIER_RANK, TIERS

Reason = Literal["timer", "pressure"]
# What a reuse predictor learns return times by: (tenant, app class, how the turn before the
# gap ended, the first tool it called). Unknown end kinds and tools are None.
ReuseKey = tuple[str, str, str | None, str | None]


@dataclass(frozen=True)
class TurnView:
    arrival: float  # when the request arrived
    prompt_tokens: int  # tokens the turn added to the context (prompt + its reply)
    finished: float | None = None  # when its reply ended; None while it runs
    end: EndKind | None = None  # how the reply ended; None while it runs or when unknown
    tool: str | None = None  # the first tool the reply called (end == "tool_call")


@dataclass(frozen=True)
class ChunkView:
    index: int
    token_start: int
    token_end: int
    tier: str | None  # None: stored nowhere, recompute it
    size_bytes: int  # in its current form
    form: str = FULL  # "full" or a kv_dtypes name ("int8", "int4", ...)
    last_access: float = 0.0

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class SessionView:
    """One conversation. `active` sessions are running or queued: their KV is in use and no
    policy touches it. The client's hints for it travel in `hints` (`SessionHints`); `pinned`,
    `priority` and `ttl_s` are the overrides in force (`pinned` is `hints.pins`: a close
    releases a pin). `kvtier serve` bounds a pin by the tenant's quota where it pins the
    session's device blocks, not here."""

    session_id: str
    tenant: str = "default"
    app_class: str = "default"
    turns: tuple[TurnView, ...] = ()
    chunks: tuple[ChunkView, ...] = ()
    active: bool = False
    idle_since: float | None = None  # end of the last turn; None while active
    pinned: bool = False
    priority: int = 0
    ttl_s: float | None = None
    hints: SessionHints = NO_HINTS

    @cached_property
    def reuse_key(self) -> ReuseKey:
        """What the reuse predictor learns gap statistics by: the key of the gap after the
        latest turn (kept: the predictor asks it of every candidate at every decision, and a
        view is reused until its session changes)."""
        return self.key_after(len(self.turns) - 1)

    def key_after(self, index: int) -> ReuseKey:
        """The key of the gap that follows turn `index` (-1 or no turns: end unknown)."""
        if 0 <= index < len(self.turns):
            turn = self.turns[index]
            return (self.tenant, self.app_class, turn.end, turn.tool)
        return (self.tenant, self.app_class, None, None)

    @property
    def last_end(self) -> EndKind | None:
        return self.turns[-1].end if self.turns else None

    @property
    def idle(self) -> bool:
        return not self.active and self.idle_since is not None

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.idle_since) if self.idle else 0.0

    def protected(self, now: float) -> bool:
        """True while no policy may move or drop this session's KV."""
        if self.pinned or not self.idle:
            return True
        return self.ttl_s is not None and self.idle_s(now) < self.ttl_s

    def stored_chunks(self) -> tuple[ChunkView, ...]:
        return self._stored

    def chunks_in(self, tier: str) -> tuple[ChunkView, ...]:
        return self._by_tier.get(tier, ())

    def oldest_first(self, tier: str) -> tuple[ChunkView, ...]:
        """`chunks_in(tier)` by (last access, index): the order LRU victims leave in."""
        memo = self.__dict__.setdefault("_oldest_first", {})
        found = memo.get(tier)
        if found is None:
            found = memo[tier] = tuple(
                sorted(self.chunks_in(tier), key=lambda c: (c.last_access, c.index))
            )
        return found

    def tiers_held(self) -> tuple[str, ...]:
        """The tiers holding at least one of this session's chunks."""
        return tuple(self._by_tier)

    @cached_property
    def _by_tier(self) -> dict[str, tuple[ChunkView, ...]]:
        by_tier: dict[str, list[ChunkView]] = {}
        for chunk in self._stored:
            by_tier.setdefault(chunk.tier, []).append(chunk)
        return {tier: tuple(chunks) for tier, chunks in by_tier.items()}

    @cached_property
    def _stored(self) -> tuple[ChunkView, ...]:
        # views are frozen and the simulator reuses a session's view until it changes, so
        # policies asking again on every decision get this without walking the chunks
        return tuple(chunk for chunk in self.chunks if chunk.tier is not None)


@dataclass(frozen=True)
class TierView:
    name: str
    used_bytes: int
    capacity_bytes: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)


@dataclass(frozen=True)
class QueueView:
    waiting_requests: int = 0
    waiting_tokens: int = 0  # tokens of KV the waiting requests need on the device


@dataclass(frozen=True)
class ViewDelta:
    """A builder's note of what changed since the previous view it built: the sessions with
    another view object than there (new ones included), in view order, and the ids of those
    it no longer has. `since` is that previous view's `token`: a policy that was not given
    that view cannot use the note and compares the views itself (`view_diff`)."""

    since: object
    changed: tuple[SessionView, ...]
    left: tuple[str, ...]


@dataclass(frozen=True)
class PolicyView:
    """The snapshot. `reason="pressure"` means the engine could not allocate: after the actions
    it needs `bytes_needed` bytes free on the device (a total, not an increment).

    `holding` is an optional index a builder that keeps one passes along (the simulator does):
    per tier, the sessions of `sessions` with a chunk there. Without it, `holders` derives the
    same from `sessions`; with it, an LRU policy looking for the device's victims among ten
    thousand sessions visits only the few hundred the device holds.

    `delta` is optional likewise: what changed since the builder's previous view (whose
    `token` it names), so a policy keeping per-session state takes in the changes alone."""

    sessions: tuple[SessionView, ...]
    tiers: tuple[TierView, ...]
    queue: QueueView = field(default_factory=QueueView)
    bytes_per_token: int = 0  # full-form KV bytes of one token, to price the queue's needs
    reason: Reason = "timer"
    bytes_needed: int = 0
    holding: Mapping[str, tuple[SessionView, ...]] | None = field(
        default=None, repr=False, compare=False
    )
    # from a builder that tracks its sessions' changes (the simulator does): with ten
    # thousand sessions and a few changed, a policy need not compare every one
    delta: ViewDelta | None = field(default=None, repr=False, compare=False)
    token: object = field(default_factory=object, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [tier.name for tier in self.tiers]
        unknown = [name for name in names if name not in TIER_RANK]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"tiers must be distinct names from {TIERS}, got {names}")
        # policies walk tiers fastest first; sorting here saves every one of them doing it
        object.__setattr__(
            self, "tiers", tuple(sorted(self.tiers, key=lambda t: TIER_RANK[t.name]))
        )

    @property
    def pressure(self) -> bool:
        return self.reason == "pressure"

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(tier.name for tier in self.tiers)

    def tier(self, name: str) -> TierView | None:
        return next((tier for tier in self.tiers if tier.name == name), None)

    @property
    def waiting_bytes(self) -> int:
        return self.queue.waiting_tokens * self.bytes_per_token

    def device_shortage(self) -> int:
        """Bytes the device must free now: what the engine asked for beyond what is free."""
        device = self.tier("device")
        if not self.pressure or device is None:
            return 0
        return max(0, self.bytes_needed - device.free_bytes)

    def candidates(self, now: float) -> tuple[SessionView, ...]:
        """Sessions a policy may act on: idle, not pinned, past any TTL override, holding KV."""
        memo = self.__dict__.get("_candidates")
        if memo is not None and memo[0] == now:
            return memo[1]  # policies ask once per tier; the answer only depends on `now`
        found = tuple(
            session
            for session in self.sessions
            if not session.protected(now) and session.stored_chunks()
        )
        self.__dict__["_candidates"] = (now, found)
        return found

    def holders(self, tier: str) -> tuple[SessionView, ...]:
        """Sessions with at least one chunk in `tier`, in no particular order."""
        if self.holding is None:
            index: dict[str, list[SessionView]] = {}
            for session in self.sessions:
                for name in session.tiers_held():
                    index.setdefault(name, []).append(session)
            object.__setattr__(
                self, "holding", {name: tuple(found) for name, found in index.items()}
            )
        return self.holding.get(tier, ())

    def candidates_in(self, tier: str, now: float) -> tuple[SessionView, ...]:
        """The `candidates` holding chunks in `tier`."""
        return tuple(session for session in self.holders(tier) if not session.protected(now))
