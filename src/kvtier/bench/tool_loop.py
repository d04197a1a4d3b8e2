"""A tool loop's turns as an agent sends them to an OpenAI-compatible server, for `kvtier bench
--server`: the workload knows which replies were tool calls, and the server learns it from the
request, as it would from a real agent.

- Every request of a session that calls tools carries `tools`: one function per tool the
  workload calls, sorted by name, the same list each time (a server writes them into the
  system prompt, so the loop's prompts keep their common start).
- A turn the workload says ends in a call names its tool in `tool_choice`, so the server's
  reply is forced into that call (and the server records the turn as ended by it); any other
  turn sends `"none"`, so the reply is read as an answer.
- In the history, such a turn's reply is the assistant's call (the one the server returned,
  its id and arguments as given, else a call of the workload's tool with arguments `{}`), and
  the message after it, the tool's result, is a `tool` message answering that call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.workload.agentic_trace import GENERIC_TOOL
from kvtier.workload.model import Request


def calls_tools(requests: Sequence[Request]) -> bool:
    """Whether these turns (a session's) are a tool loop sent as tool messages: chat turns, one
    of which ends in a call."""
    return any(r.end == "tool_call" for r in requests) and all(r.messages for r in requests)


def tool_name(request: Request) -> str:
    return request.tool or GENERIC_TOOL


def tool_definitions(requests: Sequence[Request]) -> list[dict[str, Any]]:
    """One function per tool the requests call, sorted by name."""
    names = sorted({tool_name(r) for r in requests if r.end == "tool_call"})
    return [
        {
            "type": "function",
            "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
        }
        for name in names
    ]


def tool_choice(request: Request) -> str | dict[str, Any]:
    if request.end == "tool_call":
        return {"type": "function", "function": {"name": tool_name(request)}}
    return "none"


def assistant_message(
    turn: Request, answer: str, call: Mapping[str, Any] | None, expected: str = ""
) -> dict[str, Any]:
    """A turn's reply as the history resends it: `answer`, the text the server gave (else the
    workload's `expected` answer); for a turn that ended in a call, `call` (the server's, else
    the workload's tool with arguments `{}`) and, with the server's call, the text before it."""
    if turn.end != "tool_call":
        return {"role": "assistant", "content": answer or expected}
    if call is None:
        call = {
            "id": f"call_{turn.turn_index}",
            "type": "function",
            "function": {"name": tool_name(turn), "arguments": "{}"},
        }
        answer = ""  # a reply that did not parse to a call is not resent as text
    return {"role": "assistant", "content": answer or None, "tool_calls": [dict(call)]}


def tool_messages(
    request: Request,
    turns: Sequence[Request],
    answers: Mapping[int, str],
    calls: Mapping[int, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """`request.messages` in tool-message shape; `turns` are the session's requests by turn
    index, `answers` and `calls` what the server replied to each earlier turn."""
    assistants = sum(m["role"] == "assistant" for m in request.messages)
    k = request.turn_index - assistants  # the turn of the next assistant message
    call_id: str | None = None  # the call the next user message answers
    messages: list[dict[str, Any]] = []
    for message in request.messages:
        if message["role"] == "assistant":
            expected = message["content"]
            reply = assistant_message(turns[k], answers.get(k, ""), calls.get(k), expected)
            messages.append(reply)
            call_id = reply["tool_calls"][0]["id"] if "tool_calls" in reply else None
            k += 1
        elif message["role"] == "user" and call_id is not None:
            result = message["content"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            call_id = None
        else:
            messages.append(dict(message))
    return messages
