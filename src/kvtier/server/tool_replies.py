"""A reply to a request with tools, in OpenAI's shape: `message.tool_calls` and finish reason
"tool_calls" when it parses to calls, else text; streamed, text that may be a call is held
back and goes out at the end as `delta.tool_calls` (or, unparsed, as text after all).

A session's turn that ended in a call is told to the engine (`mark_turn_end`): the retention
policy learns how long a session waits on each tool.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from kvtier.models.tool_parsers import ParsedReply, ToolCall

if TYPE_CHECKING:
    from kvtier.engine import Engine
    from kvtier.server.tools import ToolTurn


def reply_message(parsed: ParsedReply, finish: str) -> tuple[dict[str, Any], str]:
    """The chat completion's message and finish reason."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if not parsed.tool_calls:
        return message, finish
    message["tool_calls"] = [_call_json(call) for call in parsed.tool_calls]
    return message, "tool_calls"


class ToolStream:
    """Text goes out as it comes until it may be a call (the parser's opening tag, or what
    could still become it); from there it is held to the end, where it is read as the whole
    reply is when not streamed."""

    def __init__(self, turn: ToolTurn) -> None:
        self.turn = turn
        self.text = ""  # the reply as generated
        self.held = turn.reply_start  # not sent yet
        self.holding = bool(turn.reply_start)
        self.parsed = ParsedReply(None, [])

    def feed(self, delta: str) -> str:
        """The text that can go out now."""
        self.text += delta
        self.held += delta
        if self.holding:
            return ""
        start = self.turn.parser.start
        at = self.held.find(start)
        self.holding = at >= 0
        if not self.holding:
            at = _partial_start(self.held, start)
        out, self.held = self.held[:at], self.held[at:]
        return out

    def finish(self, finish: str) -> tuple[str, list[dict[str, Any]], str]:
        """What is left to send: text, `delta.tool_calls` entries and the finish reason."""
        self.parsed = self.turn.read(self.text)
        if self.parsed.tool_calls:
            calls = [{"index": i, **_call_json(c)} for i, c in enumerate(self.parsed.tool_calls)]
            return "", calls, "tool_calls"
        held, self.held = self.held, ""
        return held, [], finish


def _partial_start(text: str, start: str) -> int:
    """Where a tail of `text` that could grow into `start` begins (len(text): none)."""
    for i in range(max(0, len(text) - len(start) + 1), len(text)):
        if start.startswith(text[i:]):
            return i
    return len(text)


async def mark_tool_call(
    engine: Engine, session_id: str | None, request_id: str, tool: str | None
) -> None:
    """Tell the engine the session's turn ended in a call of `tool` (`ToolTurn.called`; None:
    no call, and the engine tells an answer from a cut-off reply itself). In a thread: the
    engine's lock is held through a model step."""
    if session_id is not None and tool is not None:
        await asyncio.to_thread(engine.mark_turn_end, session_id, request_id, "tool_call", tool)


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
