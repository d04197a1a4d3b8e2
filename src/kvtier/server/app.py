"""The OpenAI-compatible FastAPI app around one Engine.

`create_app(engine, config)` -> FastAPI. The engine's steps run in its own background thread
(`Engine.stream`); every call in the routes that takes the engine lock (stats, admin) runs in a
worker thread, so the event loop never waits on a model step.

The routes live in three routers: `routes_openai` (the OpenAI API), `routes_admin` (/admin)
and `routes_health` (/health, /metrics). Each is built from the app's `ServerState`
(`state.py`), given explicitly: the routes close over a typed object rather than fishing an
untyped `request.app.state` attribute out of every request, and need no dependency of their
own to get it, so their dependencies (and the OpenAPI schema) are the API's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from kvtier.server.api_errors import add_error_handlers
from kvtier.server.middleware import BodyLimitMiddleware, InternalErrorMiddleware
from kvtier.server.routes_admin import admin_router
from kvtier.server.routes_health import health_router
from kvtier.server.routes_openai import openai_router
from kvtier.server.state import ServerState
from kvtier.settings.server import ServerConfig

if TYPE_CHECKING:
    from kvtier.engine import Engine


log = logging.getLogger(__name__)


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState(engine, config)
    if (config.max_prompt_tokens or 0) > state.max_prompt_tokens:
        log.warning(
            "max_prompt_tokens %d leaves no room to answer in the model's %d-token context; "
            "prompts of up to %d tokens are served",
            config.max_prompt_tokens,
            engine.max_model_len,
            state.max_prompt_tokens,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.add_block_listener(state.tenant_cache)
        for what, key, flag in (
            ("the admin API", config.admin_key, "--admin-key"),
            ("/metrics", config.metrics_key, "--metrics-key"),
        ):
            if key is None:
                log.warning("%s answers loopback clients only (no %s given)", what, flag)
        try:
            yield
        finally:
            # Drain: refuse new work, let in-flight streams finish (uvicorn stops accepting
            # connections first and waits for open ones up to its graceful timeout).
            state.draining = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.idle.wait(), config.graceful_shutdown_s)
            await asyncio.to_thread(state.tenant_cache.unpin_all)  # give the blocks back
            engine.remove_block_listener(state.tenant_cache)

    # The schema and its pages describe every route, admin ones included: off unless asked.
    docs = {} if config.api_docs else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(title="kvtier", version="1", lifespan=lifespan, **docs)
    app.state.kvtier = state
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s
    )
    app.add_middleware(InternalErrorMiddleware)  # added last: the outermost
    add_error_handlers(app)
    # The OpenAI API first: a request is matched against the routers in turn, and it is
    # the one most requests are for.
    app.include_router(openai_router(state))
    app.include_router(health_router(state))
    app.include_router(admin_router(state))
    return app
