"""What a request's `pin` and `close` hints do to its tenant's device blocks in `kvtier serve`,
beside the engine's record of every hint (which the retention policy reads).

- `pin`: refused before it runs (409 `quota_exceeded`) when the tenant's other sessions
  already hold its whole device quota pinned. Otherwise, when the turn ends, the session's
  cached device blocks are pinned as the admin pin pins them (`TenantCache.pin_session`: all
  of them within the quota, or none; none is counted in `kvtier:session_pins_over_quota`).
  They stay pinned until a `close`, an admin unpin, evict or clear, or shutdown.
- `close`: when the turn ends, the session is unpinned and the idle device blocks its turns
  filled are dropped, as the admin evict drops them (`TenantCache.evict_session`). A tier
  below the device gets them as it gets any evicted block; what stays there is the
  retention policy's to drop. With both, `close` wins.

Both act before the turn's last output reaches the client: a client holding its answer
sees their effect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvtier.server.api_errors import APIError
from kvtier.server.tenants import plain_session

if TYPE_CHECKING:
    from kvtier.engine.engine import RequestOutput
    from kvtier.server.auth import Caller
    from kvtier.server.session_hints_request import RequestHints
    from kvtier.server.state import ServerState
    from kvtier.session_hints import SessionHints


class SessionHintEffects:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def admit(self, who: Caller, session_id: str | None, request: RequestHints) -> None:
        """Count the request's hints; refuse a pin its tenant's quota leaves no room for."""
        metrics, model = self.state.metrics, self.state.config.model_name
        for name in request.given:
            metrics.session_hints.labels(model, who.tenant, name).inc()
        hints = request.hints
        if session_id is None or not hints.pin or hints.close:
            return
        cache = self.state.tenant_cache
        room = await asyncio.to_thread(cache.pin_room, who.tenant, plain_session(session_id))
        if room is not None and room <= 0:
            metrics.request_rejected.labels(model, who.tenant, "409").inc()
            raise APIError(
                409,
                "pinning this session would exceed the tenant's device quota (its other "
                "sessions hold all of it pinned)",
                param=request.given["pin"],
                code="quota_exceeded",
            )

    def follow(
        self,
        stream: AsyncIterator[RequestOutput],
        who: Caller,
        session_id: str | None,
        hints: SessionHints,
    ) -> AsyncIterator[RequestOutput]:
        """`stream`, with the hints applied when its turn ends."""
        if session_id is None or not (hints.pin or hints.close):
            return stream
        return self._applied_at_end(stream, who.tenant, plain_session(session_id), hints)

    async def _applied_at_end(
        self,
        stream: AsyncIterator[RequestOutput],
        tenant: str,
        session: str,
        hints: SessionHints,
    ) -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                if out.finished:  # the engine has released the turn's blocks
                    await asyncio.to_thread(self._apply, tenant, session, hints)
                yield out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]  # left early: abort it

    def _apply(self, tenant: str, session: str, hints: SessionHints) -> None:
        cache = self.state.tenant_cache
        if hints.close:
            cache.evict_session(tenant, session)
        elif cache.pin_session(tenant, session) is None:
            cache.withdraw_pin(tenant, session)  # nor does the policy count it pinned
            model = self.state.config.model_name
            self.state.metrics.session_pins_over_quota.labels(model, tenant).inc()
