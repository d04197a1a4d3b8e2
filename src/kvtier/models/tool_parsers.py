"""Tool calls in a model's reply, one parser per output format (vLLM's `--tool-call-parser`),
chosen by the `[server] tool_call_parser` setting.

A parser reads a reply's completed text into the content before its first call and the
calls. A reply whose calls are not all well-formed is content, never an error: a small model
does not always close its JSON, and the client should see what it wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text: OpenAI's `function.arguments`


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the text before the first call; None when there is none
    tool_calls: list[ToolCall]


class ToolParser(Protocol):
    start: str  # opens a call: a stream holds back text that may become one
    end: str  # closes a call: a forced call stops there

    def parse(self, text: str) -> ParsedReply: ...

    def call_text(self, call: ToolCall) -> str:
        """A call as the model writes it (assistant turns are rendered back so)."""
        ...

    def forced_start(self, name: str | None) -> str:
        """The start of a reply that can only go on as a call (of `name`, if given)."""
        ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one object per tag: the
    format of NousResearch's Hermes 2 Pro, Qwen 2.5 and SmolLM2's model card (which puts a
    list of such objects in one tag; that is read too)."""

    start = "<tool_call>"
    end = "</tool_call>"
    _calls = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
    _arguments_key = re.compile(r'"arguments"\s*:\s*')

    def parse(self, text: str) -> ParsedReply:
        at = text.find(self.start)
        if at < 0:
            return ParsedReply(text, [])
        calls: list[ToolCall] = []
        for match in self._calls.finditer(text, at):
            body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
            read = _read_calls(body)
            if read is None:
                return ParsedReply(text, [])
            calls += read
        if not calls:
            return ParsedReply(text, [])
        return ParsedReply(text[:at].strip() or None, calls)

    def call_text(self, call: ToolCall) -> str:
        return f"{self.forced_start(call.name)} {call.arguments}}}\n{self.end}"

    def forced_start(self, name: str | None) -> str:
        if name is None:
            return f'{self.start}\n{{"name": "'
        # Ends at the colon, not after its space: " {" is one token, so the prompt's tokens
        # are those the next turn's prompt has, where the arguments follow.
        return f'{self.start}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":'


def _read_calls(body: str) -> list[ToolCall] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    objects = value if isinstance(value, list) else [value]
    calls = []
    for obj in objects:
        call = _call(obj, body if len(objects) == 1 else None)
        if call is None:
            return None
        calls.append(call)
    return calls


def _call(obj: Any, body: str | None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], _arguments_text(body, arguments))


def _arguments_text(body: str | None, arguments: dict[str, Any]) -> str:
    """The arguments as the model wrote them, where that is one JSON object: the client sends
    them back, and the next turn's prompt then has the tokens this reply's KV was made of."""
    written = json.dumps(arguments, ensure_ascii=False)
    key = HermesParser._arguments_key.search(body) if body is not None else None
    if body is None or key is None:
        return written
    try:
        value, end = json.JSONDecoder().raw_decode(body, key.end())
    except ValueError:
        return written
    return body[key.end() : end] if value == arguments else written


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": HermesParser()}
DEFAULT_TOOL_PARSER = "hermes"
