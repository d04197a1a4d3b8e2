"""The idle gaps still running, per reuse key, kept up to date from view changes.

Every idle session has been idle at least its age so far, and how many of them will never come
back is not known yet: the reuse predictor counts them as censored gaps in its life table
(`ReusePredictor.censor`). A view reuses a session's object until the session changes, so the
idle set is updated from `view_diff.Changes` rather than read from every session at every
decision (ten thousand sessions, several decisions a second in the simulator). Each key's
idle-since times are one array, a session taking the last slot's place when it leaves, so a
decision reads every key's running gaps without a pass over Python objects.
"""

from __future__ import annotations

import numpy as np

from kvtier.policy.predictor import Key
from kvtier.policy.view_diff import Changes


class _Slots:
    """One key's idle sessions: their idle-since times in `since[:len(ids)]`, ids alongside."""

    def __init__(self) -> None:
        self.since = np.zeros(16)
        self.ids: list[str] = []


class RunningGaps:
    def __init__(self) -> None:
        self._keys: dict[Key, _Slots] = {}
        self._where: dict[str, tuple[_Slots, int]] = {}  # session id -> its key's slots, index

    def update(self, changes: Changes) -> None:
        """Take in the sessions that changed or left since the previous view."""
        for session_id in changes.left:
            self._forget(session_id)
        for session in changes.changed:
            self._forget(session.session_id)
            if session.idle:
                slots = self._keys.get(session.reuse_key)
                if slots is None:
                    slots = self._keys[session.reuse_key] = _Slots()
                at = len(slots.ids)
                if at == len(slots.since):
                    slots.since = np.concatenate([slots.since, np.zeros(at)])
                slots.since[at] = float(session.idle_since)
                slots.ids.append(session.session_id)
                self._where[session.session_id] = (slots, at)

    def ages(self, now: float) -> dict[Key, np.ndarray]:
        """How long each idle session of each key has been idle at `now` (in no particular
        order within a key)."""
        return {
            key: np.maximum(now - slots.since[: len(slots.ids)], 0.0)
            for key, slots in self._keys.items()
            if slots.ids
        }

    def _forget(self, session_id: str) -> None:
        found = self._where.pop(session_id, None)
        if found is None:
            return
        slots, at = found
        last = len(slots.ids) - 1
        moved = slots.ids.pop()
        if at != last:  # the last slot's session takes this one
            slots.ids[at] = moved
            slots.since[at] = slots.since[last]
            self._where[moved] = (slots, at)
