"""Which sessions of a policy view are new or changed since the previous view, and which left.

The simulator and the engine reuse a session's view object until something about the session
changes, so one identity check per session finds the few to look at. What a policy keeps per
session (the cost policy's pricing table, its turn tracker and its demand forecast) is then
updated from the same changes: one pass over ten thousand sessions per decision, not one each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.policy.view import SessionView


@dataclass(frozen=True)
class Changes:
    changed: tuple[SessionView, ...]  # new, or with another view object than before; view order
    left: tuple[str, ...]  # ids of the sessions seen before that the view no longer has


def diff(sessions: Sequence[SessionView], last: Mapping[str, tuple[Any, ...]]) -> Changes:
    """The changes from `last` (session id -> a record whose first item is the view it was
    seen with) to `sessions`."""
    changed = []
    known = 0  # sessions of the view seen before
    for session in sessions:
        before = last.get(session.session_id)
        if before is None:
            changed.append(session)
        else:
            known += 1
            if before[0] is not session:
                changed.append(session)
    left: tuple[str, ...] = ()
    if known != len(last):
        present = {session.session_id for session in sessions}
        left = tuple(sid for sid in last if sid not in present)
    return Changes(tuple(changed), left)


class ViewDiff:
    """`diff` against the previous view given to `update`."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[SessionView]] = {}

    def update(self, sessions: Sequence[SessionView]) -> Changes:
        changes = diff(sessions, self._last)
        last = self._last
        for session_id in changes.left:
            del last[session_id]
        for session in changes.changed:
            last[session.session_id] = (session,)
        return changes
