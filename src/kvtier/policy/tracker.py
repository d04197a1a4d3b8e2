"""Turns successive views into what the predictor learns from: a session came back after a gap,
or stayed away past the cut-off age. Policies run on a timer and see only snapshots, so the
tracker remembers how many turns each session had; sessions that leave the view are forgotten
(memory is bounded by the sessions the engine tracks)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvtier.policy.view import PolicyView, ReuseKey, SessionView
from kvtier.policy.view_diff import Changes, diff


@dataclass(frozen=True)
class Returned:
    session_id: str
    key: ReuseKey
    gap_s: float  # from the end of the previous turn to this arrival
    at: float  # arrival time


@dataclass(frozen=True)
class Abandoned:
    session_id: str
    key: ReuseKey
    at: float  # when the session's idle time passed the cut-off


SessionEvent = Returned | Abandoned


class TurnTracker:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        # per session: the view last seen, turns seen, already counted abandoned
        self._seen: dict[str, tuple[SessionView, int, bool]] = {}
        # (idle since, order, session id) of each idle session not counted abandoned, earliest
        # first: a session passing the cut-off age is found here instead of by visiting every
        # session at every update. One entry per idle period: an idle session's view changes
        # each time a policy moves its chunks, and an entry per view would be popped and
        # skipped as stale an hour later, at every decision. A session's entry is for the idle
        # period its last seen view was in; an entry whose session has moved on is skipped
        self._idle: list[tuple[float, int, str]] = []
        self._pushed = 0

    def update(
        self, view: PolicyView, now: float, changes: Changes | None = None
    ) -> list[SessionEvent]:
        """The events since the previous view. `changes`: the view's against the previous
        one, where the caller has them already (`view_diff.ViewDiff`)."""
        events: list[SessionEvent] = []
        seen = self._seen
        if changes is None:
            changes = diff(view.sessions, seen)
        for session_id in changes.left:  # sessions that left the view are forgotten
            seen.pop(session_id, None)
        # views are reused until the session changes: only changed ones have news
        for session in changes.changed:
            self._visit(session, seen.get(session.session_id), now, events)
        idle = self._idle
        while idle and now - idle[0][0] >= self.max_age_s:
            since, _, session_id = heapq.heappop(idle)
            before = seen.get(session_id)
            # still in the idle period it was queued for, and not yet counted abandoned
            if before is not None and before[0].idle_since == since and not before[2]:
                self._visit(before[0], before, now, events)
        # in session order (each session's own events stay in turn order): what the predictor
        # learns does not depend on the order of the view
        events.sort(key=lambda event: event.session_id)
        return events

    def _visit(
        self,
        session: SessionView,
        before: tuple[SessionView, int, bool] | None,
        now: float,
        events: list[SessionEvent],
    ) -> None:
        """Add the session's events since `before` (what was seen of it; None: nothing)."""
        turns = session.turns
        # a session seen for the first time contributes from its next turn on
        seen, abandoned = (len(turns), False) if before is None else before[1:]
        for i in range(max(seen, 1), len(turns)):
            ended = turns[i - 1].finished
            # a return after abandonment was already counted as "no return"
            if ended is not None and not (abandoned and i == seen):
                gap = turns[i].arrival - ended
                events.append(
                    Returned(session.session_id, session.key_after(i - 1), gap, turns[i].arrival)
                )
        abandoned = abandoned and len(turns) == seen
        if not abandoned and session.idle and session.idle_s(now) >= self.max_age_s:
            at = session.idle_since + self.max_age_s
            events.append(Abandoned(session.session_id, session.reuse_key, at))
            abandoned = True
        # queued when a view of this idle period was last seen (idle, not yet abandoned: its
        # visit pushed the entry or found it pushed); a session seen afresh is queued again
        queued = (
            before is not None and before[0].idle and before[0].idle_since == session.idle_since
        )
        if session.idle and not abandoned and not queued:
            heapq.heappush(self._idle, (session.idle_since, self._pushed, session.session_id))
            self._pushed += 1
        self._seen[session.session_id] = (session, len(turns), abandoned)
