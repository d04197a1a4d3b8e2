"""A chat request's tools: its messages checked and put in the chat template's shape, and
what `tools` and `tool_choice` change about the turn (the prompt's tools, a forced start of
the reply, how the reply is read).

Forcing is by prompt, not by constrained decoding: `required` or a named function starts
the reply with the parser's call opening (`<tool_call>\\n{"name": "get_weather",
"arguments":`) and stops it at the call's end. The arguments are the model's to write, and
may still not be JSON; such a reply is answered as text, but a session's turn forced into
a named tool still counts as ended by a call of it (`ToolTurn.called`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.models.tool_parsers import ParsedReply, ToolParser
from kvtier.server.api_errors import APIError
from kvtier.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice


@dataclass(frozen=True)
class ToolTurn:
    tools: list[dict[str, Any]]  # OpenAI's shape, for the chat template
    parser: ToolParser
    reads_calls: bool  # False under tool_choice "none": the reply is text, whatever it says
    reply_start: str  # a forced call's opening: ends the prompt, begins the reply's text
    first_call_only: bool  # parallel_tool_calls false
    forced: str | None = None  # the tool the reply was forced to call, when tool_choice names it

    @property
    def stop(self) -> list[str]:
        """A forced reply ends with its one call."""
        return [self.parser.end] if self.reply_start else []

    def called(self, parsed: ParsedReply) -> str | None:
        """The tool the reply called: its first call's, else the forced tool's. A forced reply
        opens with the call and the tool's name, written by the server, so the model was
        calling that tool even where its arguments do not parse: the client gets text, but the
        session waits on that tool as an agent's would (a replay that forces an agent's
        recorded calls relies on it)."""
        return parsed.tool_calls[0].name if parsed.tool_calls else self.forced

    def read(self, text: str) -> ParsedReply:
        """The reply's content and calls. Calls of a tool not offered (a small model invents
        names) make it text, as a malformed call does: the client could not run them."""
        whole = self.reply_start + text
        if not self.reads_calls:
            return ParsedReply(whole, [])
        parsed = self.parser.parse(whole)
        offered = {tool["function"]["name"] for tool in self.tools}
        if any(call.name not in offered for call in parsed.tool_calls):
            return ParsedReply(whole, [])
        if self.first_call_only:
            return ParsedReply(parsed.content, parsed.tool_calls[:1])
        return parsed


def tool_turn(body: ChatCompletionRequest, parser: ToolParser) -> ToolTurn | None:
    """None when the request has no tools (its reply is plain text)."""
    choice = body.tool_choice
    if not body.tools:
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
        return None
    names = [tool.function.name for tool in body.tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(400, f"two tools are named {name!r}", param=f"tools.{i}.function.name")
    forced: str | None = None
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in names:
            raise APIError(
                400, f"tool_choice names {forced!r}, which is not in tools", param="tool_choice"
            )
    elif choice == "required" and len(names) == 1:
        forced = names[0]  # the one tool there is: its arguments are all left to write
    reply_start = ""
    if forced is not None or choice == "required":
        reply_start = parser.forced_start(forced)
    return ToolTurn(
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools],
        parser=parser,
        reads_calls=choice != "none",
        reply_start=reply_start,
        first_call_only=body.parallel_tool_calls is False,
        forced=forced,
    )


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; a tool result must answer a call made
    earlier in the conversation, and only assistants make calls."""
    called: set[str] = set()
    rendered = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": message.text()}
        if message.tool_calls:
            if role != "assistant":
                raise APIError(
                    400,
                    "only assistant messages carry tool_calls",
                    param=f"messages.{i}.tool_calls",
                )
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            called.update(call.id for call in message.tool_calls)
        if role == "tool":
            if message.tool_call_id is None:
                raise APIError(
                    400,
                    "a tool message needs the tool_call_id of the call it answers",
                    param=f"messages.{i}.tool_call_id",
                )
            if message.tool_call_id not in called:
                raise APIError(
                    400,
                    f"tool_call_id {message.tool_call_id!r} matches no earlier assistant tool call",
                    param=f"messages.{i}.tool_call_id",
                )
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered
