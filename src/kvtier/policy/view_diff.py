"""Which sessions of a policy view are new or changed since the previous view, and which left.

The simulator and the engine reuse a session's view object until something about the session
changes, so one identity check per session finds the few to look at (and the simulator, which
knows what it changed, hands the policy that list with the view: `PolicyView.delta`). What a
policy keeps per session (the cost policy's pricing table, its turn tracker and its demand
forecast) is then updated from the same changes, not by walking every session for each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any

from kvtier.policy.view import PolicyView, SessionView

_SESSION_ID = attrgetter("session_id")
_FIRST = itemgetter(0)
_UNSEEN = (None,)


@dataclass(frozen=True)
class Changes:
    changed: tuple[SessionView, ...]  # new, or with another view object than before; view order
    left: tuple[str, ...]  # ids of the sessions seen before that the view no longer has


def diff(sessions: Sequence[SessionView], last: Mapping[str, tuple[Any, ...]]) -> Changes:
    """The changes from `last` (session id -> a record whose first item is the view it was
    seen with) to `sessions`."""
    # C-level maps, no Python step per session (a view can hold ten thousand): a session
    # not seen before gets `_UNSEEN`, whose view is None, so it counts as changed
    ids = list(map(_SESSION_ID, sessions))
    befores = list(map(last.get, ids, repeat(_UNSEEN)))
    changed = tuple(compress(sessions, map(is_not, map(_FIRST, befores), sessions)))
    left: tuple[str, ...] = ()
    if sum(map(is_not, befores, repeat(_UNSEEN))) != len(last):  # some seen before are gone
        present = set(ids)
        left = tuple(sid for sid in last if sid not in present)
    return Changes(changed, left)


class ViewDiff:
    """`diff` against the previous view given to `update`, or the view's own `delta` where it
    is against that view (the builder already knows what changed: no pass over every
    session)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[SessionView]] = {}
        self._token: object = None  # the previous view's

    def update(self, sessions: Sequence[SessionView], view: PolicyView | None = None) -> Changes:
        """The changes of `sessions` (those of `view`, when given) since the previous call."""
        delta = None if view is None else view.delta
        if delta is not None and self._token is not None and delta.since is self._token:
            changes = Changes(delta.changed, delta.left)
        else:
            changes = diff(sessions, self._last)
        self._token = None if view is None else view.token
        last = self._last
        for session_id in changes.left:
            del last[session_id]
        for session in changes.changed:
            last[session.session_id] = (session,)
        return changes
