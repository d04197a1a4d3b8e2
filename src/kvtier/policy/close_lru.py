"""LRU offload that frees a session's KV as soon as its client closes the session.

SGLang's sessions (`/open_session`, `/close_session`) release a closed session's KV from the
radix tree at once, and its eviction then works on what is left. This is that rule as a
baseline: every idle session whose latest hint says `close` has its KV dropped from every
tier; the rest follows `offload`'s LRU cascade. Without close hints it decides as `offload`
does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.policy.actions import Action, Drop
from kvtier.policy.ledger import Ledger
from kvtier.policy.offload import OffloadPolicy
from kvtier.policy.view import PolicyView


@dataclass
class CloseAwareLruPolicy(OffloadPolicy):
    name = "close-lru"

    def decide(self, view: PolicyView, now: float) -> list[Action]:
        ledger = Ledger(view)
        actions: list[Action] = []
        closed = [s for s in view.candidates(now) if s.hints.close]
        for session in sorted(closed, key=lambda s: s.session_id):  # whatever the view's order
            for chunk in session.stored_chunks():
                drop = Drop(session.session_id, chunk.index)
                ledger.apply(drop)
                actions.append(drop)
        return actions + self.cascade(view, ledger, now)
