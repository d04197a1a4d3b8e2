"""Session tracker: ties the turns of a conversation and classifies each turn.

A turn is `new` (first of its session), `continuing` (arrives within `resume_after_s` of the
previous turn's end, while its KV is presumably still hot) or `resumed` (later: the KV may
have been evicted or moved down a tier). Each turn also records how much of its prompt was
found on device. Time comes from an injectable `Clock` so trace replays and the simulator can
run in trace time.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, replace

from kvtier.clock import Clock, RealClock
from kvtier.session_hints import NO_HINTS, EndKind, SessionHints


class TurnKind(enum.StrEnum):
    NEW = "new"
    CONTINUING = "continuing"
    RESUMED = "resumed"


@dataclass(slots=True)
class TurnRecord:
    session_id: str
    turn_index: int
    request_id: str
    kind: TurnKind
    gap_s: float | None  # since the previous turn ended (None for the first turn)
    num_prompt_tokens: int
    started_at: float
    num_cached_tokens: int | None = None  # set when the turn is first scheduled
    ended_at: float | None = None
    end: EndKind | None = None  # how its reply ended (a server that parses tool calls says)
    tool: str | None = None  # the first tool its reply called
    hints: SessionHints = NO_HINTS  # what its request said about the session's future

    @property
    def prefix_on_device(self) -> float | None:
        """Fraction of the prompt whose KV was found in the device prefix cache."""
        if self.num_cached_tokens is None:
            return None
        return self.num_cached_tokens / self.num_prompt_tokens


class SessionTracker:
    """Turn records per session, with bounded memory for a server that runs for weeks: each
    session keeps its last `max_turns` turns, a session idle for `forget_after_s` is
    forgotten (its next turn counts as new), and beyond `max_sessions` the session whose
    latest turn is the oldest is forgotten (`num_evicted` counts them). A forgotten session
    leaves the retention policy's view too, and its KV the tiers: the cap need not be above
    the sessions whose KV the tiers can hold."""

    def __init__(
        self,
        clock: Clock | None = None,
        resume_after_s: float = 30.0,
        forget_after_s: float = 24 * 3600.0,
        max_turns: int = 64,
        max_sessions: int = 10_000,
    ) -> None:
        self.clock = clock or RealClock()
        self.resume_after_s = resume_after_s
        self.forget_after_s = forget_after_s
        self.max_turns = max_turns
        self.max_sessions = max_sessions
        self.num_evicted = 0
        # In the order each was first seen: the retention policy's view lists them so.
        self.sessions: dict[str, deque[TurnRecord]] = {}
        self._recent: dict[str, None] = {}  # the same, latest turn last
        self._last_sweep = -math.inf
        self._turn_count: dict[str, int] = {}
        self._by_request: dict[str, TurnRecord] = {}

    def start_turn(
        self,
        session_id: str,
        request_id: str,
        num_prompt_tokens: int,
        hints: SessionHints = NO_HINTS,
    ) -> TurnRecord:
        now = self.clock.now()
        self._forget_idle(now)
        turns = self.sessions.get(session_id)
        if turns is None:
            turns = self.sessions[session_id] = deque(maxlen=self.max_turns)
            while len(self.sessions) > self.max_sessions:
                self._forget(next(iter(self._recent)))
                self.num_evicted += 1
        self._recent.pop(session_id, None)
        self._recent[session_id] = None
        if not turns:
            kind, gap = TurnKind.NEW, None
        else:
            # A turn that arrives while the previous one still runs is plainly continuing.
            previous_end = turns[-1].ended_at if turns[-1].ended_at is not None else now
            gap = now - previous_end
            kind = TurnKind.CONTINUING if gap <= self.resume_after_s else TurnKind.RESUMED
        index = self._turn_count.get(session_id, 0)
        self._turn_count[session_id] = index + 1
        record = TurnRecord(
            session_id=session_id,
            turn_index=index,
            request_id=request_id,
            kind=kind,
            gap_s=gap,
            num_prompt_tokens=num_prompt_tokens,
            started_at=now,
            hints=hints,
        )
        turns.append(record)
        self._by_request[request_id] = record
        return record

    def _forget_idle(self, now: float) -> None:
        # A sweep over all sessions, at most once per tenth of the expiry age: amortised O(1)
        # per turn, and a session is forgotten at most 10% later than asked.
        if now - self._last_sweep < self.forget_after_s / 10:
            return
        self._last_sweep = now
        for session_id, turns in list(self.sessions.items()):
            last = turns[-1]
            if last.ended_at is not None and now - last.ended_at > self.forget_after_s:
                self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        del self.sessions[session_id], self._recent[session_id]
        del self._turn_count[session_id]

    def record_prefix(self, request_id: str, num_cached_tokens: int) -> None:
        record = self._by_request.get(request_id)
        if record is not None:
            record.num_cached_tokens = num_cached_tokens

    def end_turn(self, request_id: str, end: EndKind | None = None) -> None:
        record = self._by_request.pop(request_id, None)
        if record is not None:
            record.ended_at = self.clock.now()
            record.end = record.end or end

    def mark_end(self, session_id: str, request_id: str, end: EndKind, tool: str | None) -> bool:
        """Say how turn `request_id` of the session ended, once its reply is parsed (a tool
        call is known only to the server's parser). False when the session or turn is gone."""
        for record in reversed(self.sessions.get(session_id, ())):
            if record.request_id == request_id:
                record.end, record.tool = end, tool
                return True
        return False

    def withdraw_pin(self, session_id: str) -> bool:
        """The `pin` of the session's latest turn is not in force (the server refused it over
        the tenant's quota, or an admin unpinned the session): the policy's view stops
        showing it pinned. False when there was no pin to withdraw."""
        turns = self.sessions.get(session_id)
        if not turns or not turns[-1].hints.pin:
            return False
        turns[-1].hints = replace(turns[-1].hints, pin=False)
        return True

    def turns(self, session_id: str) -> list[TurnRecord]:
        return list(self.sessions.get(session_id, []))
