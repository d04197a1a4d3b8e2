"""Health and metrics: /health (503 while draining) and the Prometheus /metrics, which
needs `Auth.metrics_reader`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from kvtier.server.auth import Auth

if TYPE_CHECKING:
    from kvtier.server.state import ServerState


def health_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics", dependencies=[Depends(Auth(state.config).metrics_reader)])
    async def metrics() -> Response:
        stats = await asyncio.to_thread(state.engine.stats)
        tenants = await asyncio.to_thread(state.tenant_cache.stats)
        return Response(
            state.metrics.render(stats, tenants),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    return router
