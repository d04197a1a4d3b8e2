"""The OpenAI API: /v1/models, /v1/chat/completions, /v1/completions.

A generation request is checked (model, limits, sampling parameters, session id and hints) and
tokenized here, admitted by `ServerState.acquire`, and answered by `responses`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvtierError
from kvtier.models.tool_parsers import TOOL_PARSERS
from kvtier.server.api_errors import APIError
from kvtier.server.auth import Auth, Caller
from kvtier.server.load_limit_request import read_load_limit
from kvtier.server.protocol import ChatCompletionRequest, CompletionRequest
from kvtier.server.responses import complete, sse
from kvtier.server.session_hint_effects import SessionHintEffects
from kvtier.server.session_hints_request import read_session_hints
from kvtier.server.tenants import scoped_session
from kvtier.server.tools import ToolTurn, template_messages, tool_turn

if TYPE_CHECKING:
    from kvtier.engine import Engine
    from kvtier.engine.engine import RequestOutput
    from kvtier.server.state import ServerState
    from kvtier.settings.server import ServerConfig

MAX_SESSION_ID_BYTES = 256


def openai_router(state: ServerState) -> APIRouter:
    engine, config = state.engine, state.config
    router = APIRouter()
    caller_dep = Depends(Auth(config).caller)
    tool_parser = TOOL_PARSERS[config.tool_call_parser]
    hint_effects = SessionHintEffects(state)

    @router.get("/v1/models")
    async def models(who: Caller = caller_dep) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(config.model_name, state.created)]}

    @router.get("/v1/models/{model_id}")
    async def model(model_id: str, who: Caller = caller_dep) -> dict[str, Any]:
        _check_model(model_id, config)
        return _model_card(config.model_name, state.created)

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, who: Caller = caller_dep
    ) -> Response:
        _check_model(body.model, config)
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        messages = template_messages(body.messages)
        tools = tool_turn(body, tool_parser)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await generate(request, who, body, "chat", messages, max_tokens, tools)

    @router.post("/v1/completions", response_model=None)
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
        return await generate(request, who, body, "text", prompt, body.max_tokens)

    async def generate(
        request: Request,
        who: Caller,
        body: Any,
        kind: str,
        prompt: Any,
        max_tokens: int | None,
        tools: ToolTurn | None = None,
    ) -> Response:
        limit = config.max_output_tokens
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}, more than this server's limit of {limit}",
                param="max_tokens",
                code="invalid_value",
            )
        token_ids = await asyncio.to_thread(_tokenize, engine, kind, prompt, tools)
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
        params = _sampling_params(body, max_tokens or default, tools.stop if tools else [])
        session_id = _session_id(request, body, who)
        hinted = read_session_hints(request.headers, body, session_id)
        connector = engine.connector
        tier_names = tuple(connector.store.tiers) if connector is not None else ()
        load_limit = read_load_limit(body.kv_transfer_params, tier_names)
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        await hint_effects.admit(who, session_id, hinted)
        state.acquire(who)
        streaming = bool(body.stream)
        replies = tools if tools is not None and tools.reads_calls else None
        stream = hint_effects.follow(
            engine.stream(
                token_ids, params, request_id, session_id, who.salt, hinted.hints, load_limit
            ),
            who,
            session_id,
            hinted.hints,
        )
        try:
            if not streaming:
                return await complete(
                    request, state, who, kind, request_id, session_id, stream, replies
                )
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
        events = sse(
            state, who, kind, request_id, session_id, first, stream, include_usage, replies
        )
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
        )

    return router


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
    return scoped_session(who.tenant, session)


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    try:
        return await anext(stream)
    except KvtierError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _tokenize(engine: Engine, kind: str, prompt: Any, tools: ToolTurn | None) -> list[int]:
    from kvtier.models.tokenizer import chat_token_ids

    if kind == "chat":
        try:
            listed, start = (tools.tools, tools.reply_start) if tools else (None, "")
            token_ids = chat_token_ids(engine.tokenizer, prompt, listed, start)
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


def _sampling_params(body: Any, max_tokens: int, tool_stop: list[str]) -> SamplingParams:
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
    if tool_stop:
        params["stop"] = params.get("stop", []) + tool_stop
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
