"""The OpenAI-compatible FastAPI app around one Engine.

`create_app(engine, config)` -> FastAPI. The engine's steps run in its own background thread
(`Engine.stream`); every call here that takes the engine lock (stats, admin) runs in a worker
thread, so the event loop never waits on a model step.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvtierError
from kvtier.server.metrics import ServerMetrics, prompt_token_sources
from kvtier.server.middleware import BodyLimitMiddleware, InternalErrorMiddleware
from kvtier.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from kvtier.server.tenants import ANONYMOUS, TenantCache, TenantCacheStats
from kvtier.settings.server import ServerConfig

if TYPE_CHECKING:
    from kvtier.engine import Engine
    from kvtier.engine.engine import RequestOutput


log = logging.getLogger(__name__)

MAX_SESSION_ID_BYTES = 256
_JSON_MEDIA_TYPE = re.compile(r"^application/([\w.+-]+\+)?json$", re.IGNORECASE)

# Pydantic's names for union members and validators in an error location, not field names.
_TYPE_TAG = re.compile(
    r"^(int|float|str|bool|none|bytes|[a-z]+\[.*\]|[A-Z]\w*|function-.*|.*-union.*)$"
)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), self.status, headers
        )


@dataclass(frozen=True)
class Caller:
    tenant: str  # name used in metrics and accounting
    salt: str | None  # what salts the block keys (None: the anonymous tenant)


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        quotas = {name: t.device_quota_bytes for name, t in config.tenants.items()}
        self.tenant_cache = TenantCache(engine, quotas)
        self.max_prompt_tokens = config.prompt_token_limit(engine.max_model_len)
        if (config.max_prompt_tokens or 0) > self.max_prompt_tokens:
            log.warning(
                "max_prompt_tokens %d leaves no room to answer in the model's %d-token context; "
                "prompts of up to %d tokens are served",
                config.max_prompt_tokens,
                engine.max_model_len,
                self.max_prompt_tokens,
            )
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


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    state = ServerState(engine, config)

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

    # ----- errors: always OpenAI-shaped, never a bare 500 for bad input -------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI reads a body of another type as bytes, which then "is not an object".
        media_type = request.headers.get("content-type", "application/json").split(";")[0]
        if not _JSON_MEDIA_TYPE.match(media_type.strip()):
            message = f"Content-Type must be application/json, got {media_type!r}"
            return JSONResponse(error_body(message, code="unsupported_media_type"), 415)
        errors = list(exc.errors())
        # A union reports one error per member; the one about the value (too long, out of
        # range) says more than "not a string" from the member the input was never meant for.
        errors.sort(key=lambda e: str(e.get("type", "")).endswith("_type"))
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        elif first.get("type") == "model_attributes_type" and not loc:
            message, param = "request body must be a JSON object", None
        else:
            param = ".".join(loc) or None
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
            others = {
                ".".join(
                    str(p) for p in e.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))
                )
                for e in errors[1:]
            } - {".".join(loc)}
            if others:
                message += f" (also invalid: {', '.join(sorted(others))})"
        return JSONResponse(error_body(message, param=param, code="invalid_value"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), exc.status_code)

    # ----- auth ---------------------------------------------------------------------------

    def bearer(request: Request) -> str | None:
        header = request.headers.get("authorization")
        if header is None:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "Authorization header must be 'Bearer <api key>'",
                "authentication_error",
                code="invalid_api_key",
            )
        return token.strip()

    # Dependencies are async: FastAPI would run a plain `def` in a worker thread, one more
    # hand-off (and GIL wait behind the step thread) before every request reaches the engine.
    async def caller(request: Request) -> Caller:
        if config.anonymous:
            return Caller(ANONYMOUS, None)
        key = bearer(request)
        if key is None:
            raise APIError(
                401,
                "missing API key: send 'Authorization: Bearer <api key>'",
                "authentication_error",
                code="missing_api_key",
            )
        tenant = config.tenant_for_key(key)
        if tenant is None:
            raise APIError(401, "invalid API key", "authentication_error", code="invalid_api_key")
        return Caller(tenant.name, tenant.name)

    caller_dep = Depends(caller)

    def guard(request: Request, what: str, key: str | None, flag: str) -> None:
        """With a key configured, the bearer must be it; without, the client must be local."""
        if key is None:
            if not _is_loopback(request):
                raise APIError(
                    403,
                    f"{what} answers loopback clients only; start the server with {flag} "
                    "to reach it from elsewhere",
                    "permission_error",
                    code="loopback_only",
                )
            return
        given = bearer(request)
        if given is None or not _consteq(given, key):
            raise APIError(
                401,
                f"{what} needs the key given by {flag}",
                "authentication_error",
                code="invalid_api_key",
            )

    async def admin(request: Request) -> None:
        guard(request, "the admin API", config.admin_key, "--admin-key")

    async def metrics_reader(request: Request) -> None:
        guard(request, "/metrics", config.metrics_key, "--metrics-key")

    # ----- plain endpoints ----------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(who: Caller = caller_dep) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(config.model_name, state.created)]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, who: Caller = caller_dep) -> dict[str, Any]:
        _check_model(model_id, config)
        return _model_card(config.model_name, state.created)

    @app.get("/metrics", dependencies=[Depends(metrics_reader)])
    async def metrics() -> Response:
        stats = await asyncio.to_thread(engine.stats)
        tenants = await asyncio.to_thread(state.tenant_cache.stats)
        return Response(
            state.metrics.render(stats, tenants),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    # ----- generation ---------------------------------------------------------------------

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, who: Caller = caller_dep
    ) -> Response:
        _check_model(body.model, config)
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        messages = [
            {"role": m.role if m.role != "developer" else "system", "content": m.text()}
            for m in body.messages
        ]
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _generate(request, who, body, "chat", messages, max_tokens)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request, who: Caller = caller_dep
    ) -> Response:
        _check_model(body.model, config)
        for name in ("echo", "suffix", "logprobs"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported", param=name)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(
                    400, "send one prompt per request (batches are not supported)", param="prompt"
                )
            prompt = prompt[0]
        if prompt == "" or prompt == []:
            raise APIError(400, "prompt is empty", param="prompt")
        return await _generate(request, who, body, "text", prompt, body.max_tokens)

    async def _generate(
        request: Request,
        who: Caller,
        body: Any,
        kind: str,
        prompt: Any,
        max_tokens: int | None,
    ) -> Response:
        limit = config.max_output_tokens
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, more than this server's limit of {limit}",
                param="max_tokens",
                code="invalid_value",
            )
        token_ids = await asyncio.to_thread(_tokenize, engine, kind, prompt)
        prompt_param = "messages" if kind == "chat" else "prompt"
        n = len(token_ids)
        if n > state.max_prompt_tokens:
            raise APIError(
                400,
                f"prompt has {n} tokens, more than this server's limit of "
                f"{state.max_prompt_tokens} (model context {engine.max_model_len})",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = engine.max_model_len - n
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the model context "
                f"({engine.max_model_len})",
                param="max_tokens",
                code="context_length_exceeded",
            )
        default = min(config.max_tokens_default, room, config.max_output_tokens or room)
        params = _sampling_params(body, max_tokens or default)
        session_id = _session_id(request, body, who)
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        state.acquire(who)
        streaming = bool(body.stream)
        stream = engine.stream(token_ids, params, request_id, session_id, who.salt)
        try:
            if not streaming:
                return await _complete(request, state, who, kind, request_id, session_id, stream)
            # Start the request before answering, so input the engine refuses is still a 4xx.
            first = await _first(stream)
        except BaseException:
            if streaming:
                state.release(who)
                with contextlib.suppress(Exception):
                    await stream.aclose()  # cancelled while waiting: abort the request now
            raise
        finally:
            if not streaming:
                state.release(who)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(state, who, kind, request_id, session_id, first, stream, include_usage)
        return StreamingResponse(
            sse,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
        )

    # ----- admin --------------------------------------------------------------------------

    @app.get("/admin/tenants", dependencies=[Depends(admin)])
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

    @app.post("/admin/tenants/{tenant}/clear", dependencies=[Depends(admin)])
    async def admin_clear(tenant: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        dropped = await asyncio.to_thread(state.tenant_cache.clear_tenant, tenant)
        return {"tenant": tenant, "evicted_blocks": dropped}

    @app.post("/admin/tenants/{tenant}/sessions/{session_id}/evict", dependencies=[Depends(admin)])
    async def admin_evict_session(tenant: str, session_id: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        dropped = await asyncio.to_thread(state.tenant_cache.evict_session, tenant, session_id)
        return {"tenant": tenant, "session_id": session_id, "evicted_blocks": dropped}

    @app.post("/admin/tenants/{tenant}/sessions/{session_id}/pin", dependencies=[Depends(admin)])
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

    @app.post("/admin/tenants/{tenant}/sessions/{session_id}/unpin", dependencies=[Depends(admin)])
    async def admin_unpin_session(tenant: str, session_id: str) -> dict[str, Any]:
        _check_tenant(tenant, config)
        n = await asyncio.to_thread(state.tenant_cache.unpin_session, tenant, session_id)
        return {"tenant": tenant, "session_id": session_id, "unpinned_blocks": n}

    return app


def _session_id(request: Request, body: Any, who: Caller) -> str | None:
    """`tenant/session` from X-Session-ID or else `user`; None without either.

    The id is kept with every cached block its turns fill, so its length is capped and the
    string interned: one copy per session, shared by all its blocks and requests.
    """
    header = request.headers.get("x-session-id")
    session, param = (header, None) if header else (body.user, "user")
    if not session:
        return None
    size = len(session.encode())
    if size > MAX_SESSION_ID_BYTES:
        name = "X-Session-ID header" if param is None else "user"
        raise APIError(
            400,
            f"{name} is {size} bytes; a session id is at most {MAX_SESSION_ID_BYTES}",
            param=param,
            code="invalid_value",
        )
    return sys.intern(f"{who.tenant}/{session}")


def _is_loopback(request: Request) -> bool:
    # Behind a proxy on this host, uvicorn takes the address from X-Forwarded-For (it trusts
    # 127.0.0.1 by default): a proxied client counts as remote only if the proxy sets it.
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await anext(stream)
    except KvtierError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _tokenize(engine: Engine, kind: str, prompt: Any) -> list[int]:
    from kvtier.models.tokenizer import chat_token_ids

    if kind == "chat":
        try:
            token_ids = chat_token_ids(engine.tokenizer, prompt)
        except Exception as exc:  # the chat template refused the messages
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    elif isinstance(prompt, str):
        token_ids = engine.tokenizer.encode(prompt)
    else:
        token_ids = list(prompt)
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    if not token_ids:
        raise APIError(400, "prompt is empty", param="prompt")
    return token_ids


def _sampling_params(body: Any, max_tokens: int) -> SamplingParams:
    params: dict[str, Any] = {"max_tokens": max_tokens}
    if body.temperature is not None:
        params["temperature"] = float(body.temperature)
    if body.top_p is not None:
        params["top_p"] = float(body.top_p)
    if body.top_k is not None:
        params["top_k"] = body.top_k
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        if any(not s for s in stops):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        params["stop"] = stops
    if body.seed is not None:
        params["seed"] = body.seed
    if body.ignore_eos is not None:
        params["ignore_eos"] = body.ignore_eos
    if body.stop_token_ids is not None:
        params["stop_token_ids"] = body.stop_token_ids
    try:
        return SamplingParams.from_dict(params)
    except KvtierError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _usage(out: RequestOutput, num_output_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, plus `kvtier.prompt_token_sources`: where the prompt's KV came from
    (device, host, disk, remote, recomputed). `cached_tokens` is every prompt token not
    recomputed, device hits and restored tokens alike."""
    sources = prompt_token_sources(out)
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": out.num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_prompt_tokens - sources["recomputed"]},
        "kvtier": {"prompt_token_sources": sources},
    }


def _finish_reason(out: RequestOutput) -> str:
    reason = out.finish_reason or "stop"
    return reason if reason in ("stop", "length") else "stop"


async def _complete(
    request: Request,
    state: ServerState,
    who: Caller,
    kind: str,
    request_id: str,
    session_id: str | None,
    stream: AsyncIterator[RequestOutput],
) -> Response:
    """Run a non-streaming request; a client that disconnects cancels it (blocks freed)."""

    async def collect() -> tuple[str, int, RequestOutput]:
        text, n, last = [], 0, None
        try:
            async for out in stream:
                text.append(out.delta_text)
                n += len(out.new_token_ids)
                last = out
        except KvtierError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        finally:
            await stream.aclose()
        assert last is not None
        return "".join(text), n, last

    task = asyncio.ensure_future(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return Response(status_code=499)
    except asyncio.CancelledError:
        task.cancel()
        raise
    text, n, last = task.result()
    _check_error(last)
    state.observe_finished(who, session_id, last, n)
    model = state.config.model_name
    created = int(time.time())
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": _finish_reason(last),
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(last)}
        obj = "text_completion"
    return JSONResponse(
        {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(last, n),
        }
    )


def _check_error(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise APIError(500, out.error or "generation failed", "server_error")


async def _sse(
    state: ServerState,
    who: Caller,
    kind: str,
    request_id: str,
    session_id: str | None,
    first: RequestOutput,
    stream: AsyncIterator[RequestOutput],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    model = state.config.model_name
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> bytes:
        if kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {
                "index": 0,
                "text": delta_text or "",
                "logprobs": None,
                "finish_reason": finish,
            }
        payload = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            payload["usage"] = None
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    n = 0
    last = first
    try:
        if kind == "chat":
            yield chunk("", None, role=True)
        out: RequestOutput | None = first
        while out is not None:
            last = out
            n += len(out.new_token_ids)
            if out.finished and out.finish_reason == "error":
                err = error_body(out.error or "generation failed", "server_error")
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
                break
            if out.delta_text:
                yield chunk(out.delta_text, None)
            if out.finished:
                yield chunk(None, _finish_reason(out))
                break
            out = await anext(stream, None)
        if last.finished:
            state.observe_finished(who, session_id, last, n)
        if include_usage:
            usage_chunk = {
                "id": request_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(last, n),
            }
            yield b"data: " + json.dumps(usage_chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        await stream.aclose()  # not finished (client gone): the engine aborts the request
        state.release(who)


def _check_model(name: str, config: ServerConfig) -> None:
    if name not in config.model_names:
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {config.model_name!r}",
            "not_found_error",
            param="model",
            code="model_not_found",
        )


def _model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "kvtier"}


def _consteq(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())
