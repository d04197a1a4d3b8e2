"""Turns successive views into what the predictor learns from: a session came back after a gap,
or stayed away past the cut-off age. Policies run on a timer and see only snapshots, so the
tracker remembers how many turns each session had; sessions that leave the view are forgotten
(memory is bounded by the sessions the engine tracks)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.policy.view import PolicyView, SessionView


@dataclass(frozen=True)
class Returned:
    session_id: str
    key: tuple[str, str]
    gap_s: float  # from the end of the previous turn to this arrival
    at: float  # arrival time


@dataclass(frozen=True)
class Abandoned:
    session_id: str
    key: tuple[str, str]
    at: float  # when the session's idle time passed the cut-off


SessionEvent = Returned | Abandoned


class TurnTracker:
    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        # per session: the view last seen, turns seen, already counted abandoned, and idle
        # since when if it is idle and not counted abandoned (None otherwise)
        self._seen: dict[str, tuple[SessionView, int, bool, float | None]] = {}

    def update(self, view: PolicyView, now: float) -> list[SessionEvent]:
        events: list[SessionEvent] = []
        seen_now: dict[str, tuple[SessionView, int, bool, float | None]] = {}
        max_age = self.max_age_s
        for session in view.sessions:
            before = self._seen.get(session.session_id)
            if before is not None and before[0] is session:
                # views are reused until the session changes: nothing new to learn from it,
                # unless it passes the cut-off age now (checked from the stored idle start:
                # most sessions are unchanged at most decisions)
                since = before[3]
                if since is None or now - since < max_age:
                    seen_now[session.session_id] = before
                    continue
            turns = session.turns
            # a session seen for the first time contributes from its next turn on
            seen, abandoned = (len(turns), False) if before is None else before[1:3]
            for i in range(max(seen, 1), len(turns)):
                ended = turns[i - 1].finished
                # a return after abandonment was already counted as "no return"
                if ended is not None and not (abandoned and i == seen):
                    gap = turns[i].arrival - ended
                    events.append(
                        Returned(session.session_id, session.reuse_key, gap, turns[i].arrival)
                    )
            abandoned = abandoned and len(turns) == seen
            if not abandoned and session.idle and session.idle_s(now) >= self.max_age_s:
                at = session.idle_since + self.max_age_s
                events.append(Abandoned(session.session_id, session.reuse_key, at))
                abandoned = True
            # idle since when, while it may still pass the cut-off age uncounted
            since = session.idle_since if session.idle and not abandoned else None
            seen_now[session.session_id] = (session, len(turns), abandoned, since)
        self._seen = seen_now
        # in session order (each session's own events stay in turn order): what the predictor
        # learns does not depend on the order of the view
        events.sort(key=lambda event: event.session_id)
        return events
