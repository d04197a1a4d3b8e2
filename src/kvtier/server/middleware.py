"""ASGI middlewares around the app: bound what a request body may cost, and turn an
unexpected exception into a generic 500 that keeps the connection open.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware), so a streamed response passes
through untouched.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import JSONResponse

from kvtier.server.protocol import error_body

log = logging.getLogger(__name__)


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes` (Content-Length or counted while reading);
    408 for a body not received in full within `timeout_s`.

    The timeout bounds what a slow client (or one that declares a body and never sends it)
    can hold: the connection, and a slot of uvicorn's connection limit. The 408 closes the
    connection, since the unread rest of the body would otherwise be parsed as a request.
    The body is buffered (at most `max_bytes`) and replayed to the app; later `receive`
    calls go to the server, so the app still sees a client disconnect.
    """

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = False
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False
        chunks: list[bytes] = []
        if not too_big:
            try:
                async with asyncio.timeout(self.timeout_s):
                    too_big = await self._read(receive, chunks)
            except TimeoutError:
                message = f"request body not received within {self.timeout_s:g} s"
                body = error_body(message, code="request_timeout")
                await JSONResponse(body, 408, {"Connection": "close"})(scope, receive, send)
                return
            if too_big is None:
                return  # the client went away
        if too_big:
            message = f"request body exceeds {self.max_bytes} bytes"
            body = error_body(message, code="request_too_large")
            await JSONResponse(body, 413)(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Any, chunks: list[bytes]) -> bool | None:
        """Append the body to `chunks`; True if it grew over the limit, None on disconnect."""
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return False


class InternalErrorMiddleware:
    """A generic 500 for an exception nothing else handled, traceback to the log.

    Starlette's own handler for `Exception` re-raises after answering, and uvicorn then
    drops the keep-alive connection; this one answers and returns. The exception text never
    reaches the client (it may name files, keys or other tenants' data). Once a response
    has started (a stream) there is no status left to send: the exception goes on to
    uvicorn, which closes the connection, the only signal left.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if started:
                raise
            body = error_body("internal server error (see the server log)", "server_error")
            await JSONResponse(body, 500)(scope, receive, send)
