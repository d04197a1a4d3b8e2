"""The idle gaps still running, per reuse key, kept up to date from view changes.

Every idle session has been idle at least its age so far, and how many of them will never come
back is not known yet: the reuse predictor counts them as censored gaps in its life table
(`ReusePredictor.censor`). A view reuses a session's object until the session changes, so the
idle set is updated from `view_diff.Changes` rather than read from every session at every
decision (ten thousand sessions, several decisions a second in the simulator).
"""

from __future__ import annotations

import numpy as np

from kvtier.policy.predictor import Key
from kvtier.policy.view_diff import Changes


class RunningGaps:
    def __init__(self) -> None:
        self._since: dict[Key, dict[str, float]] = {}  # key -> session id -> idle since
        self._key_of: dict[str, Key] = {}

    def update(self, changes: Changes) -> None:
        """Take in the sessions that changed or left since the previous view."""
        for session_id in changes.left:
            self._forget(session_id)
        for session in changes.changed:
            self._forget(session.session_id)
            if session.idle:
                key = session.reuse_key
                self._since.setdefault(key, {})[session.session_id] = float(session.idle_since)
                self._key_of[session.session_id] = key

    def ages(self, now: float) -> dict[Key, np.ndarray]:
        """How long each idle session of each key has been idle at `now`."""
        return {
            key: np.maximum(now - np.fromiter(since.values(), float, len(since)), 0.0)
            for key, since in self._since.items()
            if since
        }

    def _forget(self, session_id: str) -> None:
        key = self._key_of.pop(session_id, None)
        if key is not None:
            del self._since[key][session_id]
