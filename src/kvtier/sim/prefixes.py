"""SharedPrefixes: the leading blocks new conversations computed, so that a later conversation
whose prompt starts the same way (a system prompt, a shared document) finds them on the device,
as the engine's prefix cache does (`Deployment.shared_prefixes`).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.sim.requests import SimRequest
from kvtier.sim.session import SimSession

SHARED_BLOCKS = 64  # leading blocks of a new conversation recorded for sharing
SHARED = ""  # block owner once two conversations computed it (no session id is empty)


class SharedPrefixes:
    def __init__(self, block_tokens: int, histories: Mapping[str, int]) -> None:
        self.block_tokens = block_tokens  # the device's, a prefix hit's unit
        self.histories = histories  # request id -> measured history tokens (a cap)
        # leading block id of a new conversation's prompt -> the session that computed it, or
        # SHARED once a second one did
        self.block_owner: dict[int, str] = {}

    def share(self, session: SimSession) -> None:
        """Record the leading blocks a new conversation computed, for later conversations
        whose prompts start the same way. Only the first SHARED_BLOCKS: shared prefixes are
        system prompts and the like, and recording every block of 100,000 requests would
        not fit in memory."""
        for block in session.hash_ids[:SHARED_BLOCKS]:
            owner = self.block_owner.setdefault(block, session.session_id)
            if owner != session.session_id:
                self.block_owner[block] = SHARED

    def shared_tokens(self, r: SimRequest) -> int:
        """Leading tokens of the prompt that other conversations computed: the engine's prefix
        cache finds them on the device (hot shared blocks are assumed to stay there). A block
        only this session computed is its own history, which the policy may have dropped."""
        session, count = r.session, 0
        for block in session.hash_ids[:SHARED_BLOCKS]:
            owner = self.block_owner.get(block)
            if owner is None or owner == session.session_id:
                break
            count += 1
        tokens = int(count * session.block_tokens)
        measured = self.histories.get(r.record.request_id)
        if measured is not None:
            tokens = min(tokens, measured)
        tokens = tokens // self.block_tokens * self.block_tokens
        return max(0, min(tokens, r.prompt - 1))
