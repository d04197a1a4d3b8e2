"""A started generation's answer: one JSON completion (`complete`) or server-sent events
(`sse`), in OpenAI's chat or text-completion shape, with kvtier's usage details.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvtier.errors import KvtierError
from kvtier.server.api_errors import APIError
from kvtier.server.metrics import prompt_token_sources
from kvtier.server.protocol import error_body
from kvtier.server.tool_replies import ToolStream, mark_tool_call, reply_message

if TYPE_CHECKING:
    from kvtier.engine.engine import RequestOutput
    from kvtier.server.auth import Caller
    from kvtier.server.state import ServerState
    from kvtier.server.tools import ToolTurn


async def complete(
    request: Request,
    state: ServerState,
    who: Caller,
    kind: str,
    request_id: str,
    session_id: str | None,
    stream: AsyncIterator[RequestOutput],
    tools: ToolTurn | None = None,
) -> Response:
    """Run a non-streaming request; a client that disconnects cancels it (blocks freed).
    With `tools` (a chat whose reply may call them), the reply is read for calls."""

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
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = _finish_reason(last)
        if tools is not None:
            parsed = tools.read(text)
            message, finish = reply_message(parsed, finish)
            await mark_tool_call(state.engine, session_id, request_id, tools.called(parsed))
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
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


async def sse(
    state: ServerState,
    who: Caller,
    kind: str,
    request_id: str,
    session_id: str | None,
    first: RequestOutput,
    stream: AsyncIterator[RequestOutput],
    include_usage: bool,
    tools: ToolTurn | None = None,
) -> AsyncIterator[bytes]:
    model = state.config.model_name
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    calls = ToolStream(tools) if tools is not None else None

    def chunk(
        delta_text: str | None,
        finish: str | None,
        role: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        if kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            if tool_calls is not None:
                delta["tool_calls"] = tool_calls
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
            text = out.delta_text if calls is None else calls.feed(out.delta_text)
            if text:
                yield chunk(text, None)
            if out.finished:
                finish = _finish_reason(out)
                if calls is not None:
                    text, call_deltas, finish = calls.finish(finish)
                    if text:
                        yield chunk(text, None)
                    for call in call_deltas:  # each whole: its name and all its arguments
                        yield chunk(None, None, tool_calls=[call])
                    called = calls.turn.called(calls.parsed)
                    await mark_tool_call(state.engine, session_id, request_id, called)
                yield chunk(None, finish)
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


def _check_error(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise APIError(500, out.error or "generation failed", "server_error")
