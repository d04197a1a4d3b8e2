"""The admin API under /admin: per-tenant cache stats, and clearing, evicting, pinning
and unpinning a tenant's cached blocks. Every route needs `Auth.admin`."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends

from kvtier.server.api_errors import APIError
from kvtier.server.auth import Auth
from kvtier.server.tenants import ANONYMOUS, TenantCacheStats

if TYPE_CHECKING:
    from kvtier.server.state import ServerState
    from kvtier.settings.server import ServerConfig


def admin_router(state: ServerState) -> APIRouter:
    config = state.config
    router = APIRouter()
    admin = Auth(config).admin

    @router.get("/admin/tenants", dependencies=[Depends(admin)])
    async def admin_tenants() -> dict[str, Any]:
        stats = await asyncio.to_thread(state.tenant_cache.stats)
        names = sorted({s.tenant for s in stats} | set(config.tenants))
        by_name = {s.tenant: asdict(s) for s in stats}
        data = []
        for name in names:
            entry = by_name.get(name) or asdict(
                TenantCacheStats(name, 0, 0, 0, 0, state.tenant_cache.quotas.get(name), 0)
            )
            entry["requests_in_flight"] = state.in_flight_by_tenant.get(name, 0)
            data.append(entry)
        return {"object": "list", "data": data}

    @router.post("/admin/tenants/{tenant}/clear", dependencies=[Depends(admin)])
    async def admin_clear(tenant: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        dropped = await asyncio.to_thread(state.tenant_cache.clear_tenant, tenant)
        return {"tenant": tenant, "evicted_blocks": dropped}

    @router.post(
        "/admin/tenants/{tenant}/sessions/{session_id}/evict", dependencies=[Depends(admin)]
    )
    async def admin_evict_session(tenant: str, session_id: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        dropped = await asyncio.to_thread(state.tenant_cache.evict_session, tenant, session_id)
        return {"tenant": tenant, "session_id": session_id, "evicted_blocks": dropped}

    @router.post("/admin/tenants/{tenant}/sessions/{session_id}/pin", dependencies=[Depends(admin)])
    async def admin_pin_session(tenant: str, session_id: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        pinned = await asyncio.to_thread(state.tenant_cache.pin_session, tenant, session_id)
        if pinned is None:
            raise APIError(
                409,
                "pinning this session would exceed the tenant's device quota",
                param="session_id",
                code="quota_exceeded",
            )
        return {"tenant": tenant, "session_id": session_id, "pinned_blocks": pinned}

    @router.post(
        "/admin/tenants/{tenant}/sessions/{session_id}/unpin", dependencies=[Depends(admin)]
    )
    async def admin_unpin_session(tenant: str, session_id: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        n = await asyncio.to_thread(state.tenant_cache.unpin_session, tenant, session_id)
        return {"tenant": tenant, "session_id": session_id, "unpinned_blocks": n}

    return router


def _check_tenant(tenant: str, config: ServerConfig) -> None:
    known = set(config.tenants) if not config.anonymous else {ANONYMOUS}
    if tenant not in known:
        raise APIError(
            404,
            f"unknown tenant {tenant!r}",
            "not_found_error",
            param="tenant",
            code="tenant_not_found",
        )
