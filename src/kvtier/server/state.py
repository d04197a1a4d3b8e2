"""`ServerState`: what the routes share, one per app.

The engine, the config, the tenant cache and the metrics, and the server's admission state:
requests in flight (in all, per tenant), draining on shutdown, the event set when idle.
`create_app` builds one and hands it to every router; it is also `app.state.kvtier`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from kvtier.server.api_errors import APIError
from kvtier.server.metrics import ServerMetrics
from kvtier.server.tenants import TenantCache

if TYPE_CHECKING:
    from kvtier.engine import Engine
    from kvtier.engine.engine import RequestOutput
    from kvtier.server.auth import Caller
    from kvtier.settings.server import ServerConfig


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        quotas = {name: t.device_quota_bytes for name, t in config.tenants.items()}
        self.tenant_cache = TenantCache(engine, quotas)
        self.max_prompt_tokens = config.prompt_token_limit(engine.max_model_len)
        self.in_flight = 0
        self.in_flight_by_tenant: dict[str, int] = {}
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.created = int(time.time())

    def acquire(self, caller: Caller) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down", "service_unavailable")
        if self.in_flight >= self.config.max_concurrent_requests:
            raise self._too_many(caller, "", self.config.max_concurrent_requests)
        held = self.in_flight_by_tenant.get(caller.tenant, 0)
        if held >= self.config.tenant_concurrency_limit:
            # its share of the server: a flood from one tenant leaves the others room
            raise self._too_many(caller, " from this tenant", self.config.tenant_concurrency_limit)
        self.in_flight += 1
        self.in_flight_by_tenant[caller.tenant] = held + 1
        self.metrics.http_in_flight.labels(self.config.model_name, caller.tenant).inc()
        self.idle.clear()

    def _too_many(self, caller: Caller, whose: str, limit: int) -> APIError:
        """A 429 for a request over a concurrency limit, counted in the metrics."""
        self.metrics.request_rejected.labels(self.config.model_name, caller.tenant, "429").inc()
        return APIError(
            429,
            f"too many concurrent requests{whose} (limit {limit}); retry later",
            "rate_limit_error",
            code="rate_limit_exceeded",
        )

    def observe_finished(
        self, caller: Caller, session_id: str | None, out: RequestOutput, num_output_tokens: int
    ) -> None:
        self.metrics.observe_finished(
            caller.tenant, out, num_output_tokens, self._turn_kind(session_id, out.request_id)
        )

    def _turn_kind(self, session_id: str | None, request_id: str) -> str | None:
        """new / continuing / resumed, as the engine's session tracker classified the turn."""
        if session_id is None:
            return None
        with contextlib.suppress(RuntimeError):  # the step thread appended meanwhile: unknown
            for turn in reversed(self.engine.sessions.turns(session_id)):
                if turn.request_id == request_id:
                    return str(turn.kind)
        return None

    def release(self, caller: Caller) -> None:
        self.in_flight -= 1
        self.in_flight_by_tenant[caller.tenant] -= 1
        self.metrics.http_in_flight.labels(self.config.model_name, caller.tenant).dec()
        if self.in_flight == 0:
            self.idle.set()
